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

from ndparallel.axolotl.key_rule import Rule, _all
from ndparallel.axolotl.noop_keys import KERNEL, NO_EFFECT_DDP, NOOP, PLUGIN_ARGS

# fmt: off
TOP: dict[str, Rule] = {
    # ---- renamed or translated (translate.py)
    **_all(
        "mapped", "bf16: auto -> true where the GPU computes in bf16, else false (said in a note)", "bf16",
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
        "mapped", "legacy -> true (the checkpointed activations to pinned host memory; disk: refused)",
        "activation_offloading",
    ),
    **_all(
        "mapped", "use_reentrant: ndparallel always checkpoints non-reentrantly (the same gradients)",
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
        "mapped", "-> checkpoints are sharded (DCP), the final model one safetensors directory",
        "fsdp_final_state_dict_type",
    ),
    **_all("mapped", "-> context_parallel_size", "sequence_parallel_degree"),
    **_all("mapped", "-> collective_timeout_s", "ddp_timeout"),
    **_all("mapped", "true -> resume_from_checkpoint: auto", "auto_resume_from_checkpoints"),
    **_all("mapped", "-> gradient_accumulation_steps = batch_size / micro_batch_size", "batch_size"),
    **_all("mapped", "< 1 -> warmup_ratio (as transformers reads it)", "warmup_steps"),
    **_all(
        "mapped", "no -> no evaluation; epoch -> evals_per_epoch: 1; steps -> eval_steps", "eval_strategy",
        "evaluation_strategy",
    ),
    **_all(
        "mapped", "no -> no checkpoints; epoch -> saves_per_epoch: 1; steps -> save_steps", "save_strategy",
    ),
    **_all("mapped", "-> tokenizer", "tokenizer_config"),
    **_all(
        "mapped", "-> dataset_cache_dir (ndparallel's keyed caches of tokenised rows)",
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
        "mapped", "the tokenizer class comes from base_model's tokenizer files (AutoTokenizer, fast)",
        "tokenizer_type", "tokenizer_use_fast", "tokenizer_legacy",
    ),
    **_all(
        "mapped", "the Hugging Face tokenizer (tokenizer.json) of base_model is used, not mistral-common",
        "tokenizer_use_mistral_common",
    ),
    **_all(
        "mapped", "-> attn_implementation (xformers, sage: sdpa)", "xformers_attention", "sage_attention",
        "eager_attention", "flex_attention",
    ),
    **_all(
        "mapped", "-> chunked_loss (the loss from hidden states in token chunks, no full logits)",
        "chunked_cross_entropy",
    ),
    **_all(
        "mapped",
        "xformers, sage, fp8, kernels-community/* -> the equivalent kernel ndparallel loads "
        "(sdpa, flash_attention_2/3)",
        "attn_implementation",
    ),
    **_all(
        "mapped", "auto -> true with a CUDA GPU (regional compile of each decoder layer)", "torch_compile",
    ),
    **_all(
        "mapped",
        "Axolotl's names: adamw_hf -> adamw_torch; muon: Muon + AdamW as Axolotl's FSDP2 "
        "DistMuon, whole matrices on every layout (docs/optimizers.md); others refused with the choices",
        "optimizer",
    ),
    **_all(
        "mapped", "cosine, linear, constant, constant_with_warmup; others refused with the choices",
        "lr_scheduler",
    ),
    **_all(
        "mapped",
        "CutCrossEntropyPlugin, LigerPlugin, ExpertParallelPlugin, KernelsPlugin, SwanLabPlugin (class "
        "name or path) -> ndparallel's equivalent, said in a note; others refused",
        "plugins",
    ),
    **_all(
        "mapped", "with metrics ⊆ [perplexity]: eval_perplexity is logged at every evaluation",
        "do_causal_lm_eval", "eval_causal_lm_metrics",
    ),
    **_all(
        "mapped", "new token rows start at the mean of the existing rows (false: refused)",
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
        "ignored", "Axolotl's command-line override switch; unknown keys are always refused here", "strict",
    ),
    **_all(
        "ignored", "ndparallel never moves a whole model to a device before sharding (meta-device init)",
        "experimental_skip_move_to_device", "low_cpu_mem_usage",
    ),
    **_all("ignored", "placement follows the layout (device: auto|cpu|cuda)", "device_map"),
    **_all(
        "ignored", NO_EFFECT_DDP, "ddp", "ddp_find_unused_parameters", "ddp_bucket_cap_mb",
        "ddp_broadcast_buffers",
    ),
    **_all(
        "ignored", "loader settings: ndparallel reads memory-mapped rows on the main thread (no workers)",
        "dataloader_pin_memory", "dataloader_num_workers", "dataloader_prefetch_factor",
        "dataloader_drop_last", "remove_unused_columns",
    ),
    **_all(
        "mapped",
        "a mapping of bos/eos/pad/unk tokens (older Axolotl's form) -> special_tokens; a list of new "
        "tokens is read as is",
        "tokens",
    ),
    **_all(
        "ignored", "tokens/s, TFLOPs, MFU and peak memory are always logged", "include_tokens_per_second",
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
        "ignored", "checkpoints always hold the optimizer (resumable); the final model is weights only",
        "save_only_model",
    ),
    **_all("ignored", "Hub access uses your token as always (hf auth login / HF_TOKEN)", "hf_use_auth_token"),
    **_all(
        "ignored", "ndparallel packs in one process and counts its steps exactly",
        "sample_packing_mp_start_method", "sample_packing_eff_est", "group_by_length",
    ),
    **_all(
        "ignored", "ndparallel's ring / all-gather attention runs context parallel (cp_comm_strategy)",
        "heads_k_stride", "ring_attn_func",
    ),
    **_all(
        "ignored", KERNEL, "lora_mlp_kernel", "lora_qkv_kernel", "lora_o_kernel", "lora_embedding_kernel",
        "flash_attn_cross_entropy", "flash_attn_fuse_mlp", "flash_attn_rms_norm", "fused_attn_kernel",
        "use_kernels", "experts_implementation", "gemma4_hybrid_attn_impl", "flex_attn_compile_kwargs",
        "large_head_attention", "flash_attn_d512", "sdpa_varlen", "batch_flattening", "flash_optimum",
    ),
    **_all(
        "ignored",
        "PEFT sets fan_in_fan_out per layer type itself (GPT-2 style Conv1D: true, nn.Linear: false)",
        "lora_fan_in_fan_out",
    ),
    **_all(
        "ignored", "with fp8: true, FSDP2 all-gathers the fp8 weights (ndparallel's fp8 path)",
        "fp8_enable_fsdp_float8_all_gather",
    ),
    **_all(
        "ignored",
        "datasets are prepared (tokenised, cached) before training: the same samples, nothing "
        "streamed (pretraining_dataset is streamed)",
        "streaming",
    ),
    **_all(
        "ignored", "NOT pushed: ndparallel does not upload; upload output_dir/final yourself (hf upload)",
        "hub_model_id", "hub_strategy", "hub_revision", "push_dataset_to_hub",
    ),
    **_all(
        "ignored", "Python's garbage collector and the CUDA cache are left to their defaults", "gc_steps",
        "torch_empty_cache_steps", "gc_collect_steps",
    ),
    **_all(
        "ignored", "the chunk size is loss_chunk_tokens (default: 256 MiB of fp32 logits per chunk)",
        "chunked_cross_entropy_num_chunks",
    ),
    **_all("ignored", "ndparallel compiles with inductor's default mode", "torch_compile_mode"),
    **_all("ignored", "tokenizer files are saved as transformers writes them", "tokenizer_save_jinja_files"),
    **_all(
        "ignored", "merging (merge_lora, export --merge) is always streamed tensor by tensor", "merge_method",
    ),
    **_all("ignored", "ndparallel trains the LoRA adapters in fp32", "peft_autocast_adapter_dtype"),
    **_all(
        "ignored", "deprecated by Axolotl (no effect there either)", "eval_table_size", "eval_max_new_tokens",
    ),
    # ---- accepted when empty / false / Axolotl's default; refused with the fix when set (noop_keys.py)
    **NOOP,
    # plugin arguments (src/axolotl/integrations/*/args.py)
    **PLUGIN_ARGS,
    # keys of Axolotl's examples that its current schema no longer has (Axolotl ignores them)
    **_all(
        "ignored", "not a key of Axolotl's schema (Axolotl ignores it too)", "debug", "test_value", "eta_min",
        "base_model_ignore_patterns", "sample_packing_seq_len_multiplier",
    ),
    **_all(
        "ignored",
        "not a key of Axolotl's schema: Axolotl ignores it, and so does ndparallel (the optimizer's "
        "epsilon is adam_epsilon: rename it to apply it)",
        "adam_eps",
    ),
}
# fmt: on
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

# fmt: off
DATASET: dict[str, Rule] = {
    **_all(
        "mapped", "-> message_property_mappings {role: ..., content: ...}", "message_field_role",
        "message_field_content",
    ),
    **_all("mapped", "-> text_field", "text_column", "field"),
    **_all(
        "noop", "per-message training flags are not supported: use roles_to_train; remove it",
        "message_field_training", "message_field_training_detail",
    ),
    **_all(
        "noop", "not supported for chat_template data here; remove it", "field_tools", "split_thinking",
        "logprobs_field", "temperature", "input_transform", "input_format", "conversation", "field_human",
        "field_model", "shards", "shards_idx", "preprocess_shards",
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
# fmt: on
"""Keys of a ``datasets:`` / ``pretraining_dataset:`` entry (not ``DatasetConfig`` fields)."""

# fmt: off
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
        "limit_all_gathers", "sync_module_states", "use_orig_params", "forward_prefetch", "backward_prefetch",
        "cpu_ram_efficient_loading", "cpu_offload_pin_memory", "min_num_params", "activation_cpu_offload",
    ),
    **_all(
        "ignored", "mixed precision follows bf16 (bf16 compute, fp32 reductions and master weights)",
        "mixed_precision_policy",
    ),
    **_all(
        "ignored", "checkpoints are sharded (DCP), the final model one safetensors directory",
        "final_state_dict_type",
    ),
}
# fmt: on
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


def set_field(t: Translation, key: str, value: Any, why: str, source: str) -> None:
    """``key: value`` unless the config sets ``key`` itself to something else (then a problem)."""
    if key in t.data and t.data[key] is not None and t.data[key] != value:
        t.problems.append(
            f"'{source}' means {key}: {short(value)} but the config sets {key}: "
            f"{short(t.data[key])}; keep one"
        )
        return
    t.data[key] = value
    if why:
        t.notes.append(why)


def is_empty(value: Any, default: Any = None) -> bool:
    """Axolotl's "not used": null, false, an empty string / list / mapping, or the key's default."""
    return (
        value is None or value is False or value in ("", [], {}) or (default is not None and value == default)
    )


def short(value: Any) -> str:
    text = json.dumps(value, default=str) if not isinstance(value, str) else value
    return text if len(text) <= 60 else text[:57] + "..."
