"""The training config's quantisation fields (Axolotl's names): QLoRA's 4-bit base and what
bitsandbytes' keys mean here. A mixin of ``TrainConfig`` (kept apart from ``schema.py``).

* ``adapter: qlora`` + ``load_in_4bit: true`` (Axolotl requires both): LoRA on a frozen base whose
  linear weights are torchao NF4 (``models.quantized``). ``adapter: lora`` + ``load_in_4bit: true``
  means the same here (a note says so).
* ``bnb_config_kwargs``: bitsandbytes' 4-bit options, mapped (``llm_int8_skip_modules``), accepted
  with no effect (compute / storage dtype, double quantisation: always on) or refused (fp4).
* ``load_in_8bit: true``: refused with the fix (no FSDP2-ready 8-bit frozen weight here yet).
* ``nf4_block_size`` / ``nf4_scaler_block_size``: ndparallel's own (tiny test models only).
* ``qat``: quantisation-aware training (Axolotl's block; ``QATSettings``, ``techniques/qat.py``).
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, field_validator, model_validator

from ndparallel.config.base import _Strict
from ndparallel.models.nf4_config import NF4Config
from ndparallel.parallel.layout_refusals import qat_layout_problem
from ndparallel.techniques.technique_options import QATOptions

_DTYPES = {
    "int4": "int4",
    "int8": "int8",
    "float8_e4m3fn": "float8",
    "fp8": "float8",
    "float8": "float8",
    "nvfp4": "nvfp4",
    "mxfp4": "mxfp4",
}


class QATSettings(_Strict):
    """Axolotl's ``qat:`` block: fake-quantise the linear layers while training (torchao), so the
    model quantised afterwards loses less. Formats and combinations: ``techniques/qat.py``."""

    weight_dtype: str = "int8"
    """int4, float8 (fp8, float8_e4m3fn), mxfp4 or nvfp4 (Axolotl's default int8 has no QAT config)."""
    activation_dtype: str | None = None
    """int8 or float8 with int4 weights, float8 with float8, mxfp4 / nvfp4 with the same; none: weights
    only."""
    group_size: int | None = Field(32, ge=1)
    """Weight values per scale (int4); nvfp4 16, mxfp4 32."""
    quantize_embedding: bool | None = False
    """Also fake-quantise the input embedding (int4 weights)."""
    fake_quant_after_n_steps: int | None = Field(None, ge=0)
    """The first N optimizer steps train without fake quantisation (int4 / float8)."""

    @field_validator("weight_dtype", "activation_dtype", mode="before")
    @classmethod
    def _dtype(cls, v: Any) -> str | None:
        if v is None:
            return None
        if str(v) not in _DTYPES:
            raise ValueError(f"{v!r} is not a QAT format: use one of {sorted(_DTYPES)}")
        return _DTYPES[str(v)]

    @model_validator(mode="after")
    def _torchao_can(self):
        from ndparallel.techniques.qat import qat_options_problem

        problem = qat_options_problem(self.options())
        if problem:
            raise ValueError(problem)
        return self

    def options(self) -> QATOptions:
        return QATOptions(
            weight_dtype=self.weight_dtype,
            activation_dtype=self.activation_dtype,
            group_size=self.group_size,
            quantize_embedding=bool(self.quantize_embedding),
            fake_quant_after_n_steps=self.fake_quant_after_n_steps,
        )


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
    qat: QATSettings | None = None
    """Quantisation-aware training (Axolotl's ``qat:``): torchao fake quantisation of every linear;
    empty: off. The saved model is unquantised (quantise it afterwards with the same settings)."""
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

    @field_validator("qat", mode="before")
    @classmethod
    def _empty_qat_is_off(cls, v: Any) -> Any:
        return None if v == {} else v

    @model_validator(mode="after")
    def _qat_alone(self):
        if self.qat is None:
            return self

        if self.load_in_4bit or getattr(self, "adapter", None) == "qlora":
            raise ValueError(
                "qat with a 4-bit base (adapter: qlora / load_in_4bit): not together, as in Axolotl; "
                "remove qat, or train LoRA on a full-precision base (adapter: lora)"
            )
        problem = qat_layout_problem(getattr(self, "tensor_parallel_size", 1), getattr(self, "fp8", False))
        if problem:
            raise ValueError(problem)
        return self

    def qat_options(self) -> QATOptions:
        return self.qat.options() if self.qat is not None else QATOptions()

    @model_validator(mode="after")
    def _qlora_needs_4bit(self):
        adapter = getattr(self, "adapter", None)
        if adapter == "qlora" and not self.load_in_4bit:
            raise ValueError(
                "adapter: qlora needs load_in_4bit: true (the 4-bit NF4 base), as in Axolotl; or use "
                "adapter: lora for a bf16/fp32 base"
            )
        if self.load_in_4bit and adapter is None:
            raise ValueError(
                "load_in_4bit: true needs adapter: qlora (a 4-bit base is frozen: only LoRA adapters "
                "train on it); remove load_in_4bit for full fine-tuning"
            )
        if self.bnb_config_kwargs and not self.load_in_4bit:
            raise ValueError(
                "bnb_config_kwargs set without load_in_4bit: true: add load_in_4bit: true and "
                "adapter: qlora, or remove bnb_config_kwargs"
            )
        return self

    def nf4_config(self):
        """The ``NF4Config`` of a 4-bit base (None without ``load_in_4bit``)."""
        if not self.load_in_4bit:
            return None
        from ndparallel.models.quantization_config import nf4_config_from_bnb

        base = NF4Config(self.nf4_block_size, self.nf4_scaler_block_size)
        return nf4_config_from_bnb({"load_in_4bit": True, **(self.bnb_config_kwargs or {})}, base)
