"""The training config's quantisation fields (Axolotl's names): QLoRA's 4-bit base and what
bitsandbytes' keys mean here. A mixin of ``TrainConfig`` (kept apart from ``config.py``).

* ``adapter: qlora`` + ``load_in_4bit: true`` (Axolotl requires both): LoRA on a frozen base whose
  linear weights are torchao NF4 (``models.quantized``). ``adapter: lora`` + ``load_in_4bit: true``
  means the same here (a note says so).
* ``bnb_config_kwargs``: bitsandbytes' 4-bit options, mapped (``llm_int8_skip_modules``), accepted
  with no effect (compute / storage dtype, double quantisation: always on) or refused (fp4).
* ``load_in_8bit: true``: refused with the fix (no FSDP2-ready 8-bit frozen weight here yet).
* ``nf4_block_size`` / ``nf4_scaler_block_size``: ndparallel's own (tiny test models only).
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, field_validator, model_validator

from ndparallel.training.config_data import _Strict


class QuantFields(_Strict):
    load_in_4bit: bool = False
    """With adapter: qlora: the frozen base's linear weights stored as 4-bit NF4 (torchao's NF4Tensor,
    ~0.52 byte/param), quantised shard by shard while loading; LoRA adapters train on top."""
    load_in_8bit: bool = False
    """An 8-bit base is not supported: false (or absent) only."""
    bnb_config_kwargs: dict[str, Any] | None = None
    """bitsandbytes' 4-bit options (Axolotl): bnb_4bit_quant_type must be nf4; llm_int8_skip_modules
    keeps modules unquantised; compute/storage dtype and double quantisation have no effect here."""
    qlora_sharded_model_loading: bool = False
    """Axolotl's sharded QLoRA loading for FSDP: always what ndparallel does (no effect)."""
    nf4_block_size: int = Field(64, ge=2)
    """Values per NF4 block (bitsandbytes and torchao: 64); smaller only for tiny test models."""
    nf4_scaler_block_size: int = Field(256, ge=2)
    """NF4 block scales per double-quantisation block (256); a weight (and each FSDP shard of it)
    must hold whole nf4_block_size x nf4_scaler_block_size groups to be quantised."""

    @field_validator("load_in_8bit")
    @classmethod
    def _no_8bit(cls, v: bool) -> bool:
        if v:
            from ndparallel.models.quantization_config import LOAD_IN_8BIT_FIX

            raise ValueError(LOAD_IN_8BIT_FIX)
        return v

    @field_validator("bnb_config_kwargs")
    @classmethod
    def _bnb(cls, v: dict | None) -> dict | None:
        if v:
            from ndparallel.models.quantization_config import nf4_config_from_bnb

            nf4_config_from_bnb({"load_in_4bit": True, **v})  # raises naming the key and the fix
        return v

    @field_validator("nf4_block_size", "nf4_scaler_block_size")
    @classmethod
    def _even(cls, v: int) -> int:
        if v % 2:
            raise ValueError(f"must be even, got {v}")
        return v

    @model_validator(mode="after")
    def _qlora_needs_4bit(self):
        adapter = getattr(self, "adapter", None)
        if adapter == "qlora" and not self.load_in_4bit:
            raise ValueError("adapter: qlora needs load_in_4bit: true (the 4-bit NF4 base), as in Axolotl; or use "
                             "adapter: lora for a bf16/fp32 base")
        if self.load_in_4bit and adapter is None:
            raise ValueError("load_in_4bit: true needs adapter: qlora (a 4-bit base is frozen: only LoRA adapters "
                             "train on it); remove load_in_4bit for full fine-tuning")
        if self.bnb_config_kwargs and not self.load_in_4bit:
            raise ValueError("bnb_config_kwargs set without load_in_4bit: true: add load_in_4bit: true and "
                             "adapter: qlora, or remove bnb_config_kwargs")
        return self

    def nf4_config(self):
        """The ``NF4Config`` of a 4-bit base (None without ``load_in_4bit``)."""
        if not self.load_in_4bit:
            return None
        from ndparallel.models.quantization_config import nf4_config_from_bnb
        from ndparallel.models.quantized import NF4Config

        base = NF4Config(self.nf4_block_size, self.nf4_scaler_block_size)
        return nf4_config_from_bnb({"load_in_4bit": True, **(self.bnb_config_kwargs or {})}, base)


def quant_notes(cfg) -> list[str]:
    """``--dry-run`` notes on the quantisation and low-bit optimizer fields."""
    from ndparallel.training.optim_lowbit import optimizer_note

    notes = []
    if cfg.load_in_4bit:
        from ndparallel.models.quantization_config import bnb_notes

        if cfg.adapter == "lora":
            notes.append("adapter: lora with load_in_4bit: true = adapter: qlora (LoRA on a 4-bit NF4 base)")
        notes.append("load_in_4bit: the base's linear weights become torchao NF4 (bitsandbytes' NF4 format with "
                     "double-quantised scales; torchao's kernels), each rank quantising only its FSDP shard "
                     "while loading; compute in " + cfg.compute_dtype_name())
        notes += [f"bnb_config_kwargs.{n}" for n in bnb_notes(cfg.bnb_config_kwargs or {})]
        if cfg.merge_lora:
            notes.append("merge_lora: the adapter is merged into the dequantised NF4 base (the weights it was "
                         "trained on), written in save_dtype")
    if cfg.qlora_sharded_model_loading:
        notes.append("qlora_sharded_model_loading: always so here (each rank reads and quantises its shard)")
    note = optimizer_note(cfg.optimizer)
    if note:
        notes.append(note)
    return notes
