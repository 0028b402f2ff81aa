"""What an Axolotl config means here: one line per field that behaves differently, for ``--dry-run``
and the start of ``train``, from the validated config. Renamed keys say nothing here; the notes of translated
Axolotl keys come
from the front door (``axolotl/translate.py``, kept in
``cfg._axolotl_notes``); fields that cannot work are refused there or by the schema
(``config/schema.py``), one line each. Also the quantisation and low-bit optimizer notes. Both are
entries of ``checks.CHECKS``."""

from __future__ import annotations

from ndparallel.config import TrainConfig
from ndparallel.models.attention import attention_kernel
from ndparallel.models.quantization_config import bnb_notes
from ndparallel.optim.names import optimizer_note


def compat_notes(cfg: TrainConfig, device_type: str | None = None) -> list[str]:
    """Notes on fields that differ from Axolotl's behaviour; ``device_type`` (the ranks' device,
    when known) adds the attention-kernel and tf32 notes."""
    notes = []
    fsdp = cfg.fsdp_config
    if fsdp.state_dict_type:
        notes.append(
            f"fsdp_config.state_dict_type: {fsdp.state_dict_type}: checkpoints are always sharded (DCP, "
            "resumable on any layout) and the final model one full safetensors directory"
        )
    if fsdp.auto_wrap_policy == "SIZE_BASED_WRAP":
        notes.append(
            "fsdp_config.auto_wrap_policy: SIZE_BASED_WRAP -> each decoder layer is one FSDP2 unit (the "
            "same training; the all-gathers are grouped per layer)"
        )
    if cfg.special_tokens or cfg.tokens:
        notes.append(
            "special_tokens / tokens: set on (or added to) the tokenizer, saved with the model; tokens "
            "new to a pretrained base_model's vocabulary grow its embeddings (new rows start at the mean row)"
        )
    if cfg.optimizer == "adamw_torch_fused":
        notes.append(
            "optimizer: adamw_torch_fused: torch AdamW with fused=True when every parameter is on CUDA, "
            "else the default kernel (same update)"
        )
    if cfg.warmup_ratio is not None:
        notes.append(
            f"warmup_ratio: {cfg.warmup_ratio:g} -> warmup_steps = ceil({cfg.warmup_ratio:g} x the run's "
            "steps), known once the data is prepared"
        )
    if cfg.saves_per_epoch:
        notes.append(
            f"saves_per_epoch: {cfg.saves_per_epoch} -> a checkpoint every steps_per_epoch // "
            f"{cfg.saves_per_epoch} steps (sharded DCP)"
        )
    if cfg.sample_packing and cfg.micro_batch_size > 1:
        notes.append(
            f"sample_packing: each micro-batch is {cfg.micro_batch_size} packed rows of sequence_len "
            "tokens (Axolotl's multipack: the same without a varlen kernel)"
        )
    multipack_keys = {"sample_packing_bin_size", "sample_packing_group_size", "multipack_real_batches"}
    if cfg.sample_packing_order != "multipack" and multipack_keys & cfg.model_fields_set:
        key = sorted(multipack_keys & cfg.model_fields_set)[0]
        notes.append(
            f"{key}: applies with sample_packing_order: multipack (Axolotl's rows); the default packs "
            "every sample at once, first fit decreasing"
        )
    if cfg.cp_comm_strategy == "alltoall":
        notes.append(
            "cp_comm_strategy: alltoall (Accelerate's name for the rotating K/V exchange) -> ring; "
            "the head-splitting all-to-all is cp_comm_strategy: ulysses"
        )
    own = cfg.context_parallel_size > 1 or (cfg.sequence_parallel and cfg.tensor_parallel_size > 1)
    if own and cfg.attn_implementation not in (None, "sdpa"):
        notes.append(
            f"attn_implementation: {cfg.attn_implementation} is replaced by ndparallel's own attention "
            "(context parallel, or sequence parallel under TP)"
        )
    elif device_type is not None:
        kernel, why = attention_kernel(cfg.attn_implementation, device_type)
        if why:
            notes.append(f"attn_implementation: {cfg.attn_implementation} -> {kernel} on this machine: {why}")
    if cfg.tf32 and device_type == "cpu":
        notes.append("tf32: no effect on CPU (it only changes CUDA fp32 matmuls)")
    return notes


def quant_notes(cfg) -> list[str]:
    """``--dry-run`` notes on the quantisation and low-bit optimizer fields."""

    notes = []
    if cfg.load_in_4bit:
        if cfg.adapter == "lora":
            notes.append("adapter: lora with load_in_4bit: true = adapter: qlora (LoRA on a 4-bit NF4 base)")
        notes.append(
            "load_in_4bit: the base's linear weights become torchao NF4 (bitsandbytes' NF4 format with "
            "double-quantised scales; torchao's kernels), each rank quantising only its FSDP shard "
            "while loading; compute in " + cfg.compute_dtype_name()
        )
        notes += [f"bnb_config_kwargs.{n}" for n in bnb_notes(cfg.bnb_config_kwargs or {})]
        if cfg.merge_lora:
            notes.append(
                "merge_lora: the adapter is merged into the dequantised NF4 base (the weights it was "
                "trained on), written in save_dtype"
            )
    if cfg.qlora_sharded_model_loading:
        notes.append("qlora_sharded_model_loading: always so here (each rank reads and quantises its shard)")
    note = optimizer_note(cfg.optimizer)
    if note:
        notes.append(note)
    return notes
