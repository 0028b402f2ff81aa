"""The Axolotl keys ndparallel accepts only when empty, false or Axolotl's default (``noop``; a few
``mapped`` or ``ignored`` among them), and the keys of Axolotl's plugins: the rest of ``keys.TOP``
(``keys.py`` says what each kind means), with the texts several rules share."""

from __future__ import annotations

from ndparallel.axolotl.key_rule import Rule, _all, _defaults

RL = (
    "preference / RL training (DPO, KTO, ORPO, SimPO, GRPO, EBFT) is not supported here: ndparallel trains "
    "causal LMs on SFT and pre-training data; remove it"
)
MM = "multimodal (image / audio) training is not supported here: ndparallel trains text causal LMs; remove it"
REWARD = "reward and process-reward models are not supported here (causal-LM training only); remove it"
QUANT = (
    "this quantised base is not supported: remove it (a 4-bit NF4 base: adapter: qlora + load_in_4bit: "
    "true; a bf16 base: bf16: true)"
)
PTQ = (
    "post-training quantisation is not a training step here: quantise the saved model afterwards (torchao's "
    "quantize_, or axolotl quantize with this config); remove it"
)
INTERNAL = "Axolotl sets it itself (internal); remove it"
OFFLOAD = (
    "offloading layer parameters is not supported: remove it (fsdp_config.cpu_offload offloads the "
    "parameters, activation_offloading the checkpointed activations)"
)
GENERATE = (
    "sample generation during training is not supported; remove it (eval_loss and perplexity are logged)"
)
TRACKER = (
    "this tracker is not supported: use wandb_project, use_tensorboard, use_mlflow, swanlab_project or "
    "use_otel_metrics; remove it"
)
OPTIM = (
    "not supported here: remove it (optimizer: adamw_torch, adamw_torch_fused or sgd; learning_rate, "
    "weight_decay)"
)
KERNEL = (
    "a kernel switch of Axolotl's: ndparallel runs transformers' modules (regional compile: "
    "torch_compile: true)"
)
LORA = (
    "not supported by ndparallel's LoRA (adapter: lora with lora_r/lora_alpha/lora_dropout/lora_target_*); "
    "remove it"
)
RAY = (
    "Ray is not used: ndparallel starts its ranks itself (ray_num_workers: N -> ndparallel train "
    "--nproc-per-node N, or torchrun across nodes); the same training"
)
NO_EFFECT_DDP = (
    "DDP / Accelerate knob: ndparallel's data parallelism is FSDP2's (no DDP buckets or unused-parameter "
    "search)"
)


# fmt: off
NOOP: dict[str, Rule] = {
    **_all(
        "noop", "put base_model's config.json in base_model (a separate config is not read)",
        "base_model_config", "cls_model_config",
    ),
    **_all(
        "mapped",
        "-> overrides_of_model_config (Axolotl's alias: fields set on base_model's config before the "
        "model is built, e.g. output_router_logits: true adds an MoE model's load-balancing loss)",
        "model_config",
    ),
    **_all(
        "noop",
        "overrides of the model's constructor arguments are not applied: use overrides_of_model_config "
        "(config.json fields), or remove it",
        "model_kwargs",
    ),
    **_all(
        "noop",
        "overrides of the model's constructor arguments are not applied: use overrides_of_model_config "
        "(config.json fields), or remove it",
        "overrides_of_model_kwargs",
    ),
    **_all(
        "mapped",
        "the model class comes from base_model's config.json (AutoModelForCausalLM picks the "
        "family's causal-LM class)",
        "type_of_model",
    ),
    **_all(
        "noop", "not supported; remove it (ndparallel trains a transformers model with its own classes)",
        "trainer_cls", "processor_kwargs", "use_onebitllms",
    ),
    **_all(
        "mapped",
        "true -> Axolotl's per-expert linears fused into transformers' Llama 4 experts on load "
        "(saved in transformers' layout; LoRA on experts.*_projs refused)",
        "llama4_linearized_experts",
    ),
    **_all(
        "mapped",
        "true with adapter: lora -> LoRA on the base in bf16/fp32 (no 8-bit base here: twice its "
        "memory, and no LLM.int8 rounding; adapter: qlora + load_in_4bit: true is the low-memory option)",
        "load_in_8bit",
    ),
    **_all("noop", QUANT, "gptq", "gptq_groupsize", "gptq_model_v1", "gptq_disable_exllama"),
    **_all(
        "mapped",
        "Mxfp4Config + {dequantize: true} -> MXFP4 expert weights dequantised on load, trained and "
        "saved unquantised (dequantize: false, other configs: refused)",
        "model_quantization_config", "model_quantization_config_kwargs",
    ),
    **_all(
        "mapped",
        "true -> the experts' fused weights stay in the base dtype (QLoRA quantises the linear "
        "layers to NF4; the experts are 3-D tensors: more memory than Axolotl's 4-bit experts)",
        "quantize_moe_experts",
    ),
    **_all("noop", PTQ, "quantization"),
    **_all("noop", OFFLOAD, "layer_offloading"),
    **_defaults(
        "noop",
        "a generic tiled MLP is not used: ndparallel tiles the model's own MLP (tiled_mlp); remove it",
        tiled_mlp_use_original_mlp=True,
    ),
    **_all(
        "noop",
        "selective activation checkpointing: use fsdp_config.ac_policy: selective "
        "(with activation_checkpointing: true)",
        "selective_checkpointing",
    ),
    **_all(
        "noop", RL, "rl", "trl", "vllm", "ebft", "rl_beta", "dpo_beta", "dpo_use_weighting",
        "dpo_label_smoothing", "precompute_ref_log_probs", "dpo_use_liger_kernel", "dpo_padding_free",
        "dpo_loss_type", "dpo_loss_weights", "dpo_use_logits_to_keep", "dpo_generate_during_eval",
        "dpo_norm_loss", "rpo_alpha", "orpo_alpha", "simpo_gamma", "cpo_alpha", "kto_desirable_weight",
        "kto_undesirable_weight", "max_prompt_len",
    ),
    **_all(
        "noop", REWARD, "reward_model", "process_reward_model", "center_rewards_coefficient", "num_labels",
    ),
    **_all(
        "noop", MM, "processor_type", "image_size", "image_resize_algorithm", "role_boundaries",
        "freeze_mm_modules",
    ),
    **_defaults(
        "noop", "checkpoints and the final model are always safetensors; remove it", save_safetensors=True,
    ),
    **_all(
        "noop", INTERNAL, "local_rank", "world_size", "is_preprocess", "preprocess_iterable",
        "axolotl_config_path", "is_falcon_derived_model", "is_llama_derived_model",
        "is_mistral_derived_model", "is_qwen_derived_model", "total_num_tokens", "total_supervised_tokens",
    ),
    **_all("noop", GENERATE, "generate_samples", "generation_top_p", "generation_top_k"),
    **_defaults(
        "noop", GENERATE, num_generation_samples=3, generation_max_new_tokens=50, generation_temperature=0.7,
        generation_prompt_ratio=0.5, generation_do_sample=True,
    ),
    **_all(
        "noop", TRACKER, "use_comet", "comet_api_key", "comet_workspace", "comet_project_name",
        "comet_experiment_key", "comet_mode", "comet_online", "comet_experiment_config", "use_trackio",
        "trackio_project_name", "trackio_run_name", "trackio_space_id",
    ),
    **_all("ignored", RAY, "use_ray", "ray_run_name"),
    **_defaults("ignored", RAY, ray_num_workers=1, resources_per_worker={"GPU": 1}),
    **_all(
        "noop", "Gradio is not used; remove it", "gradio_title", "gradio_share", "gradio_server_name",
        "gradio_server_port", "gradio_max_new_tokens", "gradio_temperature",
    ),
    **_all(
        "noop", "LISA / ReLoRA / jagged restarts are not supported; remove it", "lisa_n_layers",
        "lisa_step_interval", "relora", "relora_prune_ratio", "relora_cpu_offload", "jagged_restart_steps",
        "jagged_restart_warmup_steps", "jagged_restart_anneal_steps",
    ),
    **_defaults(
        "noop", "LISA / ReLoRA are not supported; remove it", lisa_layers_attribute="model.layers",
        relora_prune_method="magnitude",
    ),
    **_all(
        "noop", OPTIM, "optim_args", "optim_target_modules", "torchdistx_path", "lr_scheduler_kwargs",
        "lr_div_factor", "lr_groups", "embedding_lr", "embedding_lr_scale", "adam_epsilon2", "adam_beta3",
        "dion_lr", "dion_momentum", "loraplus_lr_ratio",
    ),
    **_all("mapped", "0 -> none (as Axolotl reads it)", "evals_per_epoch", "saves_per_epoch"),
    **_defaults(
        "noop", OPTIM, dion_rank_fraction=1.0, dion_rank_multiple_of=1, qgalore_rank=256,
        qgalore_update_proj_gap=200, qgalore_scale=0.25, qgalore_proj_type="std", qgalore_proj_quant=True,
        qgalore_proj_bits=4, qgalore_proj_group_size=256, qgalore_cos_threshold=0.4, qgalore_gamma_proj=2,
        qgalore_queue_size=5, loraplus_lr_embedding=1e-6,
    ),
    **_all(
        "noop", LORA, "lora_rank_pattern", "lora_alpha_pattern", "peft_layers_to_transform",
        "peft_layers_pattern", "peft", "peft_use_dora", "peft_layer_replication",
        "peft_trainable_token_indices", "peft_ensure_weight_tying", "lora_on_cpu",
    ),
    **_all(
        "noop", "ndparallel initialises LoRA as PEFT does by default (A random, B zero); remove it",
        "peft_init_lora_weights",
    ),
    **_all(
        "noop", "NEFTune noise is not supported; remove it", "neftune_noise_alpha", "noisy_embedding_alpha",
    ),
    **_all(
        "noop", "PoSE is not supported; remove it", "use_pose", "pose_split_on_token_ids",
        "pose_max_context_len", "pose_num_chunks",
    ),
    **_all(
        "noop", "not supported; remove it (ndparallel's attention: attn_implementation)", "scaling_softmax",
        "scaling_softmax_factor", "scaling_softmax_bias", "s2_attention",
    ),
    **_all(
        "noop",
        "fp32 norms under bf16 are not supported (ndparallel keeps fp32 master weights of every "
        "parameter); remove it",
        "fp32_norms", "fp32_norm_classes",
    ),
    **_all("noop", "EAFT (entropy-aware focal loss) is not supported; remove it", "use_eaft"),
    **_defaults("noop", "EAFT is not supported; remove it", eaft_alpha=1.0, eaft_k=20),
    **_all(
        "noop",
        "best-model tracking is not supported: every checkpoint is kept per save_total_limit; remove it",
        "load_best_model_at_end", "metric_for_best_model", "greater_is_better",
    ),
    **_all(
        "noop",
        "the torch profiler is not wired in: use ndparallel train --profile-comm (collectives), or remove it",
        "profiler_steps",
    ),
    **_defaults("noop", "the torch profiler is not wired in; remove it", profiler_steps_start=0),
    **_all(
        "noop", "a dynamic checkpoint trigger is not supported: use save_steps; remove it",
        "dynamic_checkpoint",
    ),
    **_all("noop", "a first-step checkpoint is not supported: use save_steps; remove it", "save_first_step"),
    **_all(
        "noop", "the batch size is fixed (micro_batch_size; ndparallel plan finds what fits); remove it",
        "auto_find_batch_size",
    ),
    **_all(
        "noop", "validation uses sequence_len; remove it (or set it to sequence_len)", "eval_sequence_len",
    ),
    **_all(
        "noop",
        "GPU memory caps are not applied: the layout decides what each GPU holds (ndparallel plan "
        "estimates it); remove it",
        "max_memory", "gpu_memory_limit",
    ),
    **_all(
        "noop", "benchmark evaluation is not supported (eval_loss and perplexity are logged); remove it",
        "do_bench_eval", "bench_dataset", "bench_split",
    ),
    **_all(
        "noop",
        "the loader shuffles the rows each epoch (seeded); remove it (curriculum_sampling: true keeps "
        "the data's order)",
        "shuffle_before_merging_datasets",
    ),
    **_all(
        "noop", "test_datasets are not supported: the validation split comes from val_set_size; remove it",
        "test_datasets",
    ),
    **_all(
        "noop",
        "sharding a dataset by hand is not supported (each rank reads its rows of the whole "
        "dataset); remove it",
        "dataset_shard_num", "dataset_shard_idx", "num_dataset_shards_to_save",
    ),
    **_all(
        "noop", "datasets are always prepared (tokenised and cached) first; remove it",
        "skip_prepare_dataset", "dataset_keep_in_memory",
    ),
    **_all(
        "noop", "the system message comes from the data (or the template's own default); remove it",
        "default_system_message",
    ),
    **_all("noop", "untrained-token fixing is not supported; remove it", "fix_untrained_tokens"),
    **_all(
        "noop",
        "overriding reserved tokens is not supported: add tokens with tokens: / special_tokens:; remove it",
        "added_tokens_overrides",
    ),
    **_all(
        "noop", "shrinking the embeddings is not supported; remove it", "shrink_embeddings",
        "embeddings_skip_upcast",
    ),
    **_all(
        "noop",
        "pad_to_sequence_len: true pads rows to sequence_len; false cuts each micro-batch after its "
        "longest row (rounded to what the layout needs); remove it",
        "pad_to_multiple_of",
    ),
    **_all(
        "noop",
        "Axolotl's streaming packer is not used: pretraining_dataset is tokenised, concatenated and "
        "cut into sequence_len blocks; remove it",
        "pretrain_multipack_buffer_size", "pretraining_sample_concatenation",
    ),
    **_defaults(
        "noop", "Axolotl's streaming packer is not used; remove it", pretrain_multipack_attn=True,
        streaming_multipack_buffer_size=10000,
    ),
    **_all(
        "mapped",
        "N (= sequence_len, or with sequence_len unset) -> sample_packing: true, sequence_len: N (its "
        "successor; today's Axolotl refuses the old key)",
        "max_packed_sequence_len",
    ),
    **_all("noop", "put rope_scaling in base_model's config.json", "rope_scaling"),
    **_all("noop", "DeepSpeed's compiler is not used (ndparallel: torch_compile); remove it", "deepcompile"),
    **_all(
        "noop", "torch.compile options are not passed (torch_compile_backend picks the backend); remove it",
        "torch_compile_options",
    ),
}
# fmt: on
"""Top-level keys accepted when empty / false / Axolotl's default; refused with the fix when set."""

# fmt: off
PLUGIN_ARGS: dict[str, Rule] = {
    **_all(
        "mapped",
        "LigerPlugin: fused cross-entropy -> chunked_loss; RMSNorm / GLU / RoPE / LayerNorm -> "
        "torch_compile (inductor fuses the same element-wise ops)",
        "liger_fused_linear_cross_entropy", "liger_cross_entropy", "liger_rms_norm", "liger_rms_norm_gated",
        "liger_glu_activation", "liger_swiglu", "liger_rope", "liger_layer_norm",
    ),
    **_all("noop", "Liger's token scaling is not supported; remove it", "liger_use_token_scaling"),
    **_defaults(
        "mapped", "CutCrossEntropyPlugin -> chunked_loss (ndparallel's memory-efficient loss)",
        cut_cross_entropy=True,
    ),
    **_all(
        "ignored",
        "a DeepEP kernel setting (ndparallel's expert parallelism: all_to_all_single, exact "
        "splits, nothing dropped: docs/moe.md)",
        "expert_parallel_token_capacity", "expert_parallel_num_rdma_bytes",
    ),
    **_defaults(
        "ignored",
        "a DeepEP kernel setting (ndparallel's expert parallelism: all_to_all_single, docs/moe.md)",
        expert_parallel_backend="deep_ep", expert_parallel_num_nvl_bytes=256 << 20,
        expert_parallel_fallback_on_unsupported=True,
    ),
    **_all(
        "ignored", KERNEL, "use_scattermoe", "use_sonicmoe", "expert_backend", "moe_grouped_backend",
        "moe_dequant_chunk_size", "moe_bnb_fast", "use_glm_dsa_kernels", "use_dsv4_kernels", "dsv4_bf16_all",
        "dsv4_shared_mlp_lora_kernel", "dense_mixer",
    ),
    **_all(
        "noop", QUANT, "nonexpert_quantization", "dsv4_fp4_grouped_mode", "dsv4_fp8_lora_kernel",
        "dsv4_fp8_nonexpert_mode", "gemma4_fp8_nonexpert", "gemma4_nf4_nonexpert", "nvfp4_merge_aware",
        "nvfp4_merge_aware_start_step", "llmcompressor",
    ),
    **_all(
        "noop", "diffusion language-model training is not supported (causal LMs only); remove it",
        "diffusion",
    ),
    **_all(
        "noop", "knowledge distillation is not supported; remove it", "kd_alpha", "kd_beta", "kd_ce_alpha",
        "kd_normalize_topk", "kd_online_server", "kd_online_server_base_url", "kd_online_topk",
        "kd_temperature", "kd_temperature_min", "kd_trainer",
    ),
    **_defaults("noop", "knowledge distillation is not supported; remove it", kd_online_timeout=120),
    **_defaults("noop", "Grokfast is not supported; remove it", grokfast_alpha=0.98, grokfast_lamb=2.0),
    **_all(
        "noop", "Spectrum layer selection is not supported: freeze with unfrozen_parameters; remove it",
        "spectrum_model_name",
    ),
    **_defaults(
        "noop", "Spectrum layer selection is not supported: freeze with unfrozen_parameters; remove it",
        spectrum_top_fraction=0.5,
    ),
    **_all(
        "noop", "lm-eval-harness runs are not wired in (evaluate output_dir/final with lm_eval); remove it",
        "lm_eval_model", "lm_eval_tasks",
    ),
    **_defaults(
        "noop", "lm-eval-harness runs are not wired in; remove it", lm_eval_batch_size=8,
        lm_eval_post_train=True,
    ),
    **_all("noop", "MoRA adapters are not supported (adapter: lora); remove it", "mora"),
    **_all(
        "noop", RL, "hatchery", "nemo_gym_auto_clone", "nemo_gym_config_paths", "nemo_gym_datasets",
        "nemo_gym_dir", "nemo_gym_max_turns", "nemo_gym_model_name", "nemo_gym_multi_turn",
    ),
    **_defaults(
        "noop", RL, nemo_gym_auto_start=True, nemo_gym_enabled=True, nemo_gym_head_port=11000,
        nemo_gym_run_timeout=300, nemo_gym_server_timeout=360, nemo_gym_verify_timeout=30,
    ),
    **_all(
        "noop",
        "give SwanLab's key in the environment (SWANLAB_API_KEY; or swanlab login), not in the "
        "config; remove it",
        "swanlab_api_key",
    ),
    **_all(
        "noop", "a private SwanLab deployment is set up with swanlab login --host HOST; remove it",
        "swanlab_api_host", "swanlab_web_host",
    ),
    **_all(
        "noop", "SwanLab's Lark notifications are not wired in; remove it", "swanlab_lark_secret",
        "swanlab_lark_webhook_url",
    ),
    **_defaults(
        "noop", "SwanLab logs metrics only (no completions, no model upload); remove it",
        swanlab_completion_log_interval=100, swanlab_completion_max_buffer=128, swanlab_log_completions=True,
        swanlab_log_model=False,
    ),
}
# fmt: on
"""Plugin arguments (src/axolotl/integrations/*/args.py)."""
