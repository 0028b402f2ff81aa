"""Every key of Axolotl's config schema that ``TrainConfig`` does not hold under the same name, and
what ndparallel does with it (docs/axolotl.md "Every key" lists them; ``tests/test_axolotl_examples.py``
checks the table against Axolotl's schema, so no Axolotl key is an "unknown key"):

* ``mapped``: translated into ndparallel fields by ``translate.py``; ``--dry-run`` says to what in
  one ``note:`` line.
* ``ignored``: accepted whatever its value; it changes nothing here (a speed switch of a kernel
  ndparallel does not use, a setting of something ndparallel does differently), and ``--dry-run``
  says so in one ``note:`` line when it is set.
* ``noop``: accepted when empty, false or Axolotl's default (``default``) — "not used" — and refused
  with ``fix`` otherwise.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Rule:
    kind: str  # mapped | ignored | noop
    text: str  # mapped: to what; ignored: why nothing changes; noop: the fix when it is set
    default: object = None  # noop: Axolotl's default value (also accepted)


def _all(kind: str, text: str, *keys: str, default=None) -> dict[str, Rule]:
    return {k: Rule(kind, text, default) for k in keys}


def _defaults(kind: str, text: str, **keys) -> dict[str, Rule]:
    return {k: Rule(kind, text, d) for k, d in keys.items()}


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

TOP: dict[str, Rule] = {
    # ---- renamed or translated (translate.py)
    **_all(
        "mapped", "bf16: auto -> true where the GPU computes in bf16, else false (said in a note)", "bf16"
    ),
    **_all("mapped", "-> bf16: true (bf16 compute; ndparallel keeps fp32 master weights)", "bfloat16"),
    **_all("mapped", "true -> bf16: false (fp32 is the default)", "float32"),
    **_all(
        "mapped",
        "true -> fp16: true (fp16 compute with fp32 master weights and dynamic loss scaling; Axolotl "
        "loads the model in fp16 instead, ndparallel keeps fp32 masters)",
        "float16",
    ),
    **_all("mapped", "auto -> true on CUDA GPUs of compute capability >= 8.0 (no effect on CPU)", "tf32"),
    **_all(
        "mapped",
        "true -> fsdp_config.activation_checkpointing: true; offload -> also activation_offloading: true",
        "gradient_checkpointing",
    ),
    **_all(
        "mapped",
        "legacy -> true (the checkpointed activations to pinned host memory; disk: refused)",
        "activation_offloading",
    ),
    **_all(
        "mapped",
        "use_reentrant: ndparallel always checkpoints non-reentrantly (the same gradients)",
        "gradient_checkpointing_kwargs",
    ),
    **_all(
        "mapped",
        "[full_shard | shard_grad_op | hybrid_shard | offload | auto_wrap] -> FSDP2 over every rank "
        "(dp_shard_size: -1), reshard_after_forward, cpu_offload",
        "fsdp",
    ),
    **_all("mapped", "1 -> FSDP2 (per-parameter sharding: the same training)", "fsdp_version"),
    **_all(
        "mapped",
        "a ZeRO config -> FSDP2 over every rank (stage 3: reshard_after_forward: true; 1-2: false; "
        "offload_param: cpu_offload)",
        "deepspeed",
    ),
    **_all(
        "mapped",
        "-> checkpoints are sharded (DCP), the final model one safetensors directory",
        "fsdp_final_state_dict_type",
    ),
    **_all("mapped", "-> context_parallel_size", "sequence_parallel_degree"),
    **_all("mapped", "-> collective_timeout_s", "ddp_timeout"),
    **_all("mapped", "true -> resume_from_checkpoint: auto", "auto_resume_from_checkpoints"),
    **_all("mapped", "-> gradient_accumulation_steps = batch_size / micro_batch_size", "batch_size"),
    **_all("mapped", "< 1 -> warmup_ratio (as transformers reads it)", "warmup_steps"),
    **_all(
        "mapped",
        "no -> no evaluation; epoch -> evals_per_epoch: 1; steps -> eval_steps",
        "eval_strategy",
        "evaluation_strategy",
    ),
    **_all(
        "mapped", "no -> no checkpoints; epoch -> saves_per_epoch: 1; steps -> save_steps", "save_strategy"
    ),
    **_all("mapped", "-> tokenizer", "tokenizer_config"),
    **_all(
        "mapped",
        "-> dataset_cache_dir (ndparallel's keyed caches of tokenised rows)",
        "dataset_prepared_path",
    ),
    **_all("mapped", "-> compile_backend", "torch_compile_backend"),
    **_all("mapped", "-> dataset_processes", "dataset_num_proc"),
    **_all(
        "mapped",
        "the model class comes from base_model's config.json (AutoModelForCausalLM picks the "
        "family's causal-LM class)",
        "model_type",
    ),
    **_all(
        "mapped",
        "the tokenizer class comes from base_model's tokenizer files (AutoTokenizer, fast)",
        "tokenizer_type",
        "tokenizer_use_fast",
        "tokenizer_legacy",
    ),
    **_all(
        "mapped",
        "the Hugging Face tokenizer (tokenizer.json) of base_model is used, not mistral-common",
        "tokenizer_use_mistral_common",
    ),
    **_all(
        "mapped",
        "-> attn_implementation (xformers, sage: sdpa)",
        "xformers_attention",
        "sage_attention",
        "eager_attention",
        "flex_attention",
    ),
    **_all(
        "mapped",
        "-> chunked_loss (the loss from hidden states in token chunks, no full logits)",
        "chunked_cross_entropy",
    ),
    **_all(
        "mapped",
        "xformers, sage, fp8, kernels-community/* -> the equivalent kernel ndparallel loads "
        "(sdpa, flash_attention_2/3)",
        "attn_implementation",
    ),
    **_all(
        "mapped", "auto -> true with a CUDA GPU (regional compile of each decoder layer)", "torch_compile"
    ),
    **_all(
        "mapped",
        "Axolotl's names: adamw_hf -> adamw_torch; muon: Muon + AdamW as Axolotl's FSDP2 "
        "DistMuon, whole matrices on every layout (docs/optimizers.md); others refused with the choices",
        "optimizer",
    ),
    **_all(
        "mapped",
        "cosine, linear, constant, constant_with_warmup; others refused with the choices",
        "lr_scheduler",
    ),
    **_all(
        "mapped",
        "CutCrossEntropyPlugin, LigerPlugin, ExpertParallelPlugin, KernelsPlugin, SwanLabPlugin (class "
        "name or path) -> ndparallel's equivalent, said in a note; others refused",
        "plugins",
    ),
    **_all(
        "mapped",
        "with metrics ⊆ [perplexity]: eval_perplexity is logged at every evaluation",
        "do_causal_lm_eval",
        "eval_causal_lm_metrics",
    ),
    **_all(
        "mapped",
        "new token rows start at the mean of the existing rows (false: refused)",
        "mean_resizing_embeddings",
    ),
    **_all(
        "mapped",
        "{gradient_accumulation_kwargs: {sync_each_batch: true}}: ndparallel reduce-scatters "
        "gradients every micro-batch already",
        "accelerator_config",
    ),
    # ---- accepted, nothing changes (a note says so when set)
    **_all(
        "ignored", "Axolotl's command-line override switch; unknown keys are always refused here", "strict"
    ),
    **_all(
        "ignored",
        "ndparallel never moves a whole model to a device before sharding (meta-device init)",
        "experimental_skip_move_to_device",
        "low_cpu_mem_usage",
    ),
    **_all("ignored", "placement follows the layout (device: auto|cpu|cuda)", "device_map"),
    **_all(
        "ignored",
        NO_EFFECT_DDP,
        "ddp",
        "ddp_find_unused_parameters",
        "ddp_bucket_cap_mb",
        "ddp_broadcast_buffers",
    ),
    **_all(
        "ignored",
        "loader settings: ndparallel reads memory-mapped rows on the main thread (no workers)",
        "dataloader_pin_memory",
        "dataloader_num_workers",
        "dataloader_prefetch_factor",
        "dataloader_drop_last",
        "remove_unused_columns",
    ),
    **_all(
        "mapped",
        "a mapping of bos/eos/pad/unk tokens (older Axolotl's form) -> special_tokens; a list of new "
        "tokens is read as is",
        "tokens",
    ),
    **_all(
        "ignored",
        "tokens/s, TFLOPs, MFU and peak memory are always logged",
        "include_tokens_per_second",
        "include_tkps",
    ),
    **_all(
        "ignored",
        "validation rows are built like training rows (packed samples never attend across "
        "samples, so the loss is the unpacked one)",
        "eval_sample_packing",
    ),
    **_all(
        "ignored",
        "evaluation uses micro_batch_size rows per rank (the token-weighted loss does not depend on it)",
        "eval_batch_size",
    ),
    **_all(
        "ignored",
        "checkpoints always hold the optimizer (resumable); the final model is weights only",
        "save_only_model",
    ),
    **_all("ignored", "Hub access uses your token as always (hf auth login / HF_TOKEN)", "hf_use_auth_token"),
    **_all(
        "ignored",
        "ndparallel packs with first-fit-decreasing on the whole dataset at once",
        "sample_packing_group_size",
        "sample_packing_bin_size",
        "sample_packing_mp_start_method",
        "multipack_real_batches",
        "sample_packing_eff_est",
        "group_by_length",
    ),
    **_all(
        "ignored",
        "ndparallel's ring / all-gather attention runs context parallel (cp_comm_strategy)",
        "heads_k_stride",
        "ring_attn_func",
    ),
    **_all(
        "ignored",
        KERNEL,
        "lora_mlp_kernel",
        "lora_qkv_kernel",
        "lora_o_kernel",
        "lora_embedding_kernel",
        "flash_attn_cross_entropy",
        "flash_attn_fuse_mlp",
        "flash_attn_rms_norm",
        "fused_attn_kernel",
        "use_kernels",
        "experts_implementation",
        "gemma4_hybrid_attn_impl",
        "flex_attn_compile_kwargs",
        "large_head_attention",
        "flash_attn_d512",
        "sdpa_varlen",
        "batch_flattening",
        "flash_optimum",
    ),
    **_all(
        "ignored",
        "PEFT sets fan_in_fan_out per layer type itself (GPT-2 style Conv1D: true, nn.Linear: false)",
        "lora_fan_in_fan_out",
    ),
    **_all(
        "ignored",
        "with fp8: true, FSDP2 all-gathers the fp8 weights (ndparallel's fp8 path)",
        "fp8_enable_fsdp_float8_all_gather",
    ),
    **_all(
        "ignored",
        "datasets are prepared (tokenised, cached) before training: the same samples, nothing "
        "streamed (pretraining_dataset is streamed)",
        "streaming",
    ),
    **_all(
        "ignored",
        "NOT pushed: ndparallel does not upload; upload output_dir/final yourself (hf upload)",
        "hub_model_id",
        "hub_strategy",
        "hub_revision",
        "push_dataset_to_hub",
    ),
    **_all(
        "ignored",
        "Python's garbage collector and the CUDA cache are left to their defaults",
        "gc_steps",
        "torch_empty_cache_steps",
        "gc_collect_steps",
    ),
    **_all(
        "ignored",
        "the chunk size is loss_chunk_tokens (default: 256 MiB of fp32 logits per chunk)",
        "chunked_cross_entropy_num_chunks",
    ),
    **_all("ignored", "ndparallel compiles with inductor's default mode", "torch_compile_mode"),
    **_all("ignored", "tokenizer files are saved as transformers writes them", "tokenizer_save_jinja_files"),
    **_all(
        "ignored", "merging (merge_lora, export --merge) is always streamed tensor by tensor", "merge_method"
    ),
    **_all("ignored", "ndparallel trains the LoRA adapters in fp32", "peft_autocast_adapter_dtype"),
    **_all(
        "ignored", "deprecated by Axolotl (no effect there either)", "eval_table_size", "eval_max_new_tokens"
    ),
    # ---- accepted when empty / false / Axolotl's default; refused with the fix when set
    **_all(
        "noop",
        "put base_model's config.json in base_model (a separate config is not read)",
        "base_model_config",
        "cls_model_config",
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
        "noop",
        "not supported; remove it (ndparallel trains a transformers model with its own classes)",
        "trainer_cls",
        "processor_kwargs",
        "use_onebitllms",
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
        "model_quantization_config",
        "model_quantization_config_kwargs",
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
        "selective activation checkpointing is not supported: use fsdp_config.activation_checkpointing",
        "selective_checkpointing",
    ),
    **_all(
        "noop",
        RL,
        "rl",
        "trl",
        "vllm",
        "ebft",
        "rl_beta",
        "dpo_beta",
        "dpo_use_weighting",
        "dpo_label_smoothing",
        "precompute_ref_log_probs",
        "dpo_use_liger_kernel",
        "dpo_padding_free",
        "dpo_loss_type",
        "dpo_loss_weights",
        "dpo_use_logits_to_keep",
        "dpo_generate_during_eval",
        "dpo_norm_loss",
        "rpo_alpha",
        "orpo_alpha",
        "simpo_gamma",
        "cpo_alpha",
        "kto_desirable_weight",
        "kto_undesirable_weight",
        "max_prompt_len",
    ),
    **_all(
        "noop", REWARD, "reward_model", "process_reward_model", "center_rewards_coefficient", "num_labels"
    ),
    **_all(
        "noop",
        MM,
        "processor_type",
        "image_size",
        "image_resize_algorithm",
        "role_boundaries",
        "freeze_mm_modules",
    ),
    **_defaults(
        "noop", "checkpoints and the final model are always safetensors; remove it", save_safetensors=True
    ),
    **_all(
        "noop",
        INTERNAL,
        "local_rank",
        "world_size",
        "is_preprocess",
        "preprocess_iterable",
        "axolotl_config_path",
        "is_falcon_derived_model",
        "is_llama_derived_model",
        "is_mistral_derived_model",
        "is_qwen_derived_model",
        "total_num_tokens",
        "total_supervised_tokens",
    ),
    **_all("noop", GENERATE, "generate_samples", "generation_top_p", "generation_top_k"),
    **_defaults(
        "noop",
        GENERATE,
        num_generation_samples=3,
        generation_max_new_tokens=50,
        generation_temperature=0.7,
        generation_prompt_ratio=0.5,
        generation_do_sample=True,
    ),
    **_all(
        "noop",
        TRACKER,
        "use_comet",
        "comet_api_key",
        "comet_workspace",
        "comet_project_name",
        "comet_experiment_key",
        "comet_mode",
        "comet_online",
        "comet_experiment_config",
        "use_trackio",
        "trackio_project_name",
        "trackio_run_name",
        "trackio_space_id",
    ),
    **_all("ignored", RAY, "use_ray", "ray_run_name"),
    **_defaults("ignored", RAY, ray_num_workers=1, resources_per_worker={"GPU": 1}),
    **_all(
        "noop",
        "Gradio is not used; remove it",
        "gradio_title",
        "gradio_share",
        "gradio_server_name",
        "gradio_server_port",
        "gradio_max_new_tokens",
        "gradio_temperature",
    ),
    **_all(
        "noop",
        "LISA / ReLoRA / jagged restarts are not supported; remove it",
        "lisa_n_layers",
        "lisa_step_interval",
        "relora",
        "relora_prune_ratio",
        "relora_cpu_offload",
        "jagged_restart_steps",
        "jagged_restart_warmup_steps",
        "jagged_restart_anneal_steps",
    ),
    **_defaults(
        "noop",
        "LISA / ReLoRA are not supported; remove it",
        lisa_layers_attribute="model.layers",
        relora_prune_method="magnitude",
    ),
    **_all(
        "noop",
        OPTIM,
        "optim_args",
        "optim_target_modules",
        "torchdistx_path",
        "lr_scheduler_kwargs",
        "lr_div_factor",
        "lr_groups",
        "embedding_lr",
        "embedding_lr_scale",
        "adam_epsilon2",
        "adam_beta3",
        "dion_lr",
        "dion_momentum",
        "loraplus_lr_ratio",
    ),
    **_all("mapped", "0 -> none (as Axolotl reads it)", "evals_per_epoch", "saves_per_epoch"),
    **_defaults(
        "noop",
        OPTIM,
        dion_rank_fraction=1.0,
        dion_rank_multiple_of=1,
        qgalore_rank=256,
        qgalore_update_proj_gap=200,
        qgalore_scale=0.25,
        qgalore_proj_type="std",
        qgalore_proj_quant=True,
        qgalore_proj_bits=4,
        qgalore_proj_group_size=256,
        qgalore_cos_threshold=0.4,
        qgalore_gamma_proj=2,
        qgalore_queue_size=5,
        loraplus_lr_embedding=1e-6,
    ),
    **_all(
        "noop",
        LORA,
        "lora_rank_pattern",
        "lora_alpha_pattern",
        "peft_layers_to_transform",
        "peft_layers_pattern",
        "peft",
        "peft_use_dora",
        "peft_layer_replication",
        "peft_trainable_token_indices",
        "peft_ensure_weight_tying",
        "lora_on_cpu",
    ),
    **_all(
        "noop",
        "ndparallel initialises LoRA as PEFT does by default (A random, B zero); remove it",
        "peft_init_lora_weights",
    ),
    **_all(
        "noop", "NEFTune noise is not supported; remove it", "neftune_noise_alpha", "noisy_embedding_alpha"
    ),
    **_all(
        "noop",
        "PoSE is not supported; remove it",
        "use_pose",
        "pose_split_on_token_ids",
        "pose_max_context_len",
        "pose_num_chunks",
    ),
    **_all(
        "noop",
        "not supported; remove it (ndparallel's attention: attn_implementation)",
        "scaling_softmax",
        "scaling_softmax_factor",
        "scaling_softmax_bias",
        "s2_attention",
    ),
    **_all(
        "noop",
        "fp32 norms under bf16 are not supported (ndparallel keeps fp32 master weights of every "
        "parameter); remove it",
        "fp32_norms",
        "fp32_norm_classes",
    ),
    **_all("noop", "EAFT (entropy-aware focal loss) is not supported; remove it", "use_eaft"),
    **_defaults("noop", "EAFT is not supported; remove it", eaft_alpha=1.0, eaft_k=20),
    **_all(
        "noop",
        "best-model tracking is not supported: every checkpoint is kept per save_total_limit; remove it",
        "load_best_model_at_end",
        "metric_for_best_model",
        "greater_is_better",
    ),
    **_all(
        "noop",
        "the torch profiler is not wired in: use ndparallel train --profile-comm (collectives), or remove it",
        "profiler_steps",
    ),
    **_defaults("noop", "the torch profiler is not wired in; remove it", profiler_steps_start=0),
    **_all(
        "noop",
        "a dynamic checkpoint trigger is not supported: use save_steps; remove it",
        "dynamic_checkpoint",
    ),
    **_all("noop", "a first-step checkpoint is not supported: use save_steps; remove it", "save_first_step"),
    **_all(
        "noop",
        "the batch size is fixed (micro_batch_size; ndparallel plan finds what fits); remove it",
        "auto_find_batch_size",
    ),
    **_all(
        "noop", "validation uses sequence_len; remove it (or set it to sequence_len)", "eval_sequence_len"
    ),
    **_all(
        "noop",
        "GPU memory caps are not applied: the layout decides what each GPU holds (ndparallel plan "
        "estimates it); remove it",
        "max_memory",
        "gpu_memory_limit",
    ),
    **_all(
        "noop",
        "benchmark evaluation is not supported (eval_loss and perplexity are logged); remove it",
        "do_bench_eval",
        "bench_dataset",
        "bench_split",
    ),
    **_all(
        "noop",
        "the loader shuffles the rows each epoch (seeded); remove it (curriculum_sampling: true keeps "
        "the data's order)",
        "shuffle_before_merging_datasets",
    ),
    **_defaults(
        "noop",
        "the loader shuffles the rows each epoch (seeded); remove it (curriculum_sampling: true "
        "keeps the data's order)",
        shuffle_merged_datasets=True,
    ),
    **_all(
        "noop",
        "test_datasets are not supported: the validation split comes from val_set_size; remove it",
        "test_datasets",
    ),
    **_all(
        "noop",
        "sharding a dataset by hand is not supported (each rank reads its rows of the whole "
        "dataset); remove it",
        "dataset_shard_num",
        "dataset_shard_idx",
        "num_dataset_shards_to_save",
    ),
    **_all(
        "noop",
        "datasets are always prepared (tokenised and cached) first; remove it",
        "skip_prepare_dataset",
        "dataset_keep_in_memory",
    ),
    **_all(
        "noop",
        "the system message comes from the data (or the template's own default); remove it",
        "default_system_message",
    ),
    **_all("noop", "untrained-token fixing is not supported; remove it", "fix_untrained_tokens"),
    **_all(
        "noop",
        "overriding reserved tokens is not supported: add tokens with tokens: / special_tokens:; remove it",
        "added_tokens_overrides",
    ),
    **_all(
        "noop",
        "shrinking the embeddings is not supported; remove it",
        "shrink_embeddings",
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
        "pretrain_multipack_buffer_size",
        "pretraining_sample_concatenation",
    ),
    **_defaults(
        "noop",
        "Axolotl's streaming packer is not used; remove it",
        pretrain_multipack_attn=True,
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
        "noop",
        "torch.compile options are not passed (torch_compile_backend picks the backend); remove it",
        "torch_compile_options",
    ),
    # plugin arguments (src/axolotl/integrations/*/args.py)
    **_all(
        "mapped",
        "LigerPlugin: fused cross-entropy -> chunked_loss; RMSNorm / GLU / RoPE / LayerNorm -> "
        "torch_compile (inductor fuses the same element-wise ops)",
        "liger_fused_linear_cross_entropy",
        "liger_cross_entropy",
        "liger_rms_norm",
        "liger_rms_norm_gated",
        "liger_glu_activation",
        "liger_swiglu",
        "liger_rope",
        "liger_layer_norm",
    ),
    **_all("noop", "Liger's token scaling is not supported; remove it", "liger_use_token_scaling"),
    **_defaults(
        "mapped",
        "CutCrossEntropyPlugin -> chunked_loss (ndparallel's memory-efficient loss)",
        cut_cross_entropy=True,
    ),
    **_all(
        "ignored",
        "a DeepEP kernel setting (ndparallel's expert parallelism: all_to_all_single, exact "
        "splits, nothing dropped: docs/moe.md)",
        "expert_parallel_token_capacity",
        "expert_parallel_num_rdma_bytes",
    ),
    **_defaults(
        "ignored",
        "a DeepEP kernel setting (ndparallel's expert parallelism: all_to_all_single, docs/moe.md)",
        expert_parallel_backend="deep_ep",
        expert_parallel_num_nvl_bytes=256 << 20,
        expert_parallel_fallback_on_unsupported=True,
    ),
    **_all(
        "ignored",
        KERNEL,
        "use_scattermoe",
        "use_sonicmoe",
        "expert_backend",
        "moe_grouped_backend",
        "moe_dequant_chunk_size",
        "moe_bnb_fast",
        "use_glm_dsa_kernels",
        "use_dsv4_kernels",
        "dsv4_bf16_all",
        "dsv4_shared_mlp_lora_kernel",
        "dense_mixer",
    ),
    **_all(
        "noop",
        QUANT,
        "nonexpert_quantization",
        "dsv4_fp4_grouped_mode",
        "dsv4_fp8_lora_kernel",
        "dsv4_fp8_nonexpert_mode",
        "gemma4_fp8_nonexpert",
        "gemma4_nf4_nonexpert",
        "nvfp4_merge_aware",
        "nvfp4_merge_aware_start_step",
        "llmcompressor",
    ),
    **_all(
        "noop", "diffusion language-model training is not supported (causal LMs only); remove it", "diffusion"
    ),
    **_all(
        "noop",
        "knowledge distillation is not supported; remove it",
        "kd_alpha",
        "kd_beta",
        "kd_ce_alpha",
        "kd_normalize_topk",
        "kd_online_server",
        "kd_online_server_base_url",
        "kd_online_topk",
        "kd_temperature",
        "kd_temperature_min",
        "kd_trainer",
    ),
    **_defaults("noop", "knowledge distillation is not supported; remove it", kd_online_timeout=120),
    **_defaults("noop", "Grokfast is not supported; remove it", grokfast_alpha=0.98, grokfast_lamb=2.0),
    **_all(
        "noop",
        "Spectrum layer selection is not supported: freeze with unfrozen_parameters; remove it",
        "spectrum_model_name",
    ),
    **_defaults(
        "noop",
        "Spectrum layer selection is not supported: freeze with unfrozen_parameters; remove it",
        spectrum_top_fraction=0.5,
    ),
    **_all(
        "noop",
        "lm-eval-harness runs are not wired in (evaluate output_dir/final with lm_eval); remove it",
        "lm_eval_model",
        "lm_eval_tasks",
    ),
    **_defaults(
        "noop",
        "lm-eval-harness runs are not wired in; remove it",
        lm_eval_batch_size=8,
        lm_eval_post_train=True,
    ),
    **_all("noop", "MoRA adapters are not supported (adapter: lora); remove it", "mora"),
    **_all(
        "noop",
        RL,
        "hatchery",
        "nemo_gym_auto_clone",
        "nemo_gym_config_paths",
        "nemo_gym_datasets",
        "nemo_gym_dir",
        "nemo_gym_max_turns",
        "nemo_gym_model_name",
        "nemo_gym_multi_turn",
    ),
    **_defaults(
        "noop",
        RL,
        nemo_gym_auto_start=True,
        nemo_gym_enabled=True,
        nemo_gym_head_port=11000,
        nemo_gym_run_timeout=300,
        nemo_gym_server_timeout=360,
        nemo_gym_verify_timeout=30,
    ),
    **_all(
        "noop",
        "give SwanLab's key in the environment (SWANLAB_API_KEY; or swanlab login), not in the "
        "config; remove it",
        "swanlab_api_key",
    ),
    **_all(
        "noop",
        "a private SwanLab deployment is set up with swanlab login --host HOST; remove it",
        "swanlab_api_host",
        "swanlab_web_host",
    ),
    **_all(
        "noop",
        "SwanLab's Lark notifications are not wired in; remove it",
        "swanlab_lark_secret",
        "swanlab_lark_webhook_url",
    ),
    **_defaults(
        "noop",
        "SwanLab logs metrics only (no completions, no model upload); remove it",
        swanlab_completion_log_interval=100,
        swanlab_completion_max_buffer=128,
        swanlab_log_completions=True,
        swanlab_log_model=False,
    ),
    # keys of Axolotl's examples that its current schema no longer has (Axolotl ignores them)
    **_all(
        "ignored",
        "not a key of Axolotl's schema (Axolotl ignores it too)",
        "debug",
        "test_value",
        "eta_min",
        "base_model_ignore_patterns",
        "sample_packing_seq_len_multiplier",
    ),
    **_all(
        "ignored",
        "not a key of Axolotl's schema: Axolotl ignores it, and so does ndparallel (the optimizer's "
        "epsilon is adam_epsilon: rename it to apply it)",
        "adam_eps",
    ),
}
"""Top-level Axolotl keys (not ``TrainConfig`` fields or aliases)."""

PLUGINS: dict[str, str] = {
    "CutCrossEntropyPlugin": "chunked_loss (ndparallel's memory-efficient loss: on where exact)",
    "LigerPlugin": "its liger_* switches: fused cross-entropy -> chunked_loss, fused norms / GLU / RoPE -> "
    "torch_compile",
    "ExpertParallelPlugin": "ndparallel's expert parallelism: expert_parallel_size (docs/moe.md)",
    "KernelsPlugin": "transformers' own modules (its kernels change speed, not the result)",
    "SwanLabPlugin": "the SwanLab tracker (use_swanlab / swanlab_project, docs/axolotl.md)",
}
"""Axolotl plugins (class names) ndparallel maps; any other is refused with the fix."""

DATASET: dict[str, Rule] = {
    **_all(
        "mapped",
        "-> message_property_mappings {role: ..., content: ...}",
        "message_field_role",
        "message_field_content",
    ),
    **_all("mapped", "-> text_field", "text_column", "field"),
    **_all(
        "noop",
        "per-message training flags are not supported: use roles_to_train; remove it",
        "message_field_training",
        "message_field_training_detail",
    ),
    **_all(
        "noop",
        "not supported for chat_template data here; remove it",
        "field_tools",
        "split_thinking",
        "logprobs_field",
        "temperature",
        "input_transform",
        "input_format",
        "conversation",
        "field_human",
        "field_model",
        "shards",
        "shards_idx",
        "preprocess_shards",
    ),
    **_all(
        "noop",
        "download that revision (hf download NAME --repo-type dataset --revision R --local-dir DIR) "
        "and set path: DIR",
        "revision",
    ),
    **_all(
        "noop",
        "datasets with custom loading code are not loaded (their files are: give data_files); remove it",
        "trust_remote_code",
    ),
}
"""Keys of a ``datasets:`` / ``pretraining_dataset:`` entry (not ``DatasetConfig`` fields)."""

FSDP: dict[str, Rule] = {
    **_all(
        "mapped",
        "FULL_SHARD -> reshard_after_forward: true; SHARD_GRAD_OP -> false; NO_SHARD -> data "
        "parallel; HYBRID_SHARD -> set dp_replicate_size x dp_shard_size",
        "sharding_strategy",
    ),
    **_all("mapped", "-> fsdp_version (1: FSDP2, the same training)", "version", "fsdp_version"),
    **_all("mapped", "-> cpu_offload", "offload_params"),
    **_all("mapped", "-> layer_classes", "transformer_layer_cls_to_wrap"),
    **_all(
        "ignored",
        "an FSDP1 knob: FSDP2 shards per parameter (original parameters, states synchronised by "
        "the sharded load, prefetching built in)",
        "limit_all_gathers",
        "sync_module_states",
        "use_orig_params",
        "forward_prefetch",
        "backward_prefetch",
        "cpu_ram_efficient_loading",
        "cpu_offload_pin_memory",
        "min_num_params",
        "activation_cpu_offload",
    ),
    **_all(
        "ignored",
        "mixed precision follows bf16 (bf16 compute, fp32 reductions and master weights)",
        "mixed_precision_policy",
    ),
    **_all(
        "ignored",
        "checkpoints are sharded (DCP), the final model one safetensors directory",
        "final_state_dict_type",
    ),
}
"""Keys of ``fsdp_config`` (after Axolotl's legacy ``fsdp_`` prefix is dropped)."""


@dataclass
class Translation:
    data: dict
    notes: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    renamed: dict[str, str] = field(default_factory=dict)
    """Where a renamed key's value went (``compile``, ``fsdp_config.cpu_offload``, ``datasets.0.text_field``)
    -> the key the config wrote there, so a value the schema refuses is named as written."""

    def refuse(self, key: str, value: Any, fix: str) -> None:
        self.problems.append(f"'{key}: {short(value)}': {fix}")

    def rename_in(self, section: dict, where: str, old: str, new: str) -> None:
        """``section[old]`` -> ``section[new]`` in a nested section (``where``: its path, e.g.
        ``fsdp_config`` or ``datasets[0]``); both keys set to different values is a problem."""
        value = section.pop(old)
        if section.get(new) is not None and section[new] != value:
            self.problems.append(
                f"'{where}.{old}: {short(value)}' and '{where}.{new}: {short(section[new])}' "
                "say different things; keep one"
            )
            return
        section[new] = value
        self.renamed[f"{where.replace('[', '.').replace(']', '')}.{new}"] = f"{where}.{old}"


def is_empty(value: Any, default: Any = None) -> bool:
    """Axolotl's "not used": null, false, an empty string / list / mapping, or the key's default."""
    return (
        value is None or value is False or value in ("", [], {}) or (default is not None and value == default)
    )


def short(value: Any) -> str:
    text = json.dumps(value, default=str) if not isinstance(value, str) else value
    return text if len(text) <= 60 else text[:57] + "..."
