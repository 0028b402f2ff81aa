"""What a user asks for as a quantised base (``quantization=`` of ``load_model`` / ``prepare_model``):
an ``NF4Config``, ``"nf4"``, or a bitsandbytes 4-bit config (transformers' ``BitsAndBytesConfig``,
Axolotl's ``bnb_config_kwargs``) read as torchao's NF4 (``quantized.NF4Config``): what maps, what has
no effect here, what is refused.

bitsandbytes' ``load_in_4bit`` with ``bnb_4bit_quant_type="nf4"`` and double quantisation is the
same format torchao's ``NF4Tensor`` stores (64-value blocks, 16 NormalFloat levels, int8 block
scales about their mean in blocks of 256); the kernels differ, so the dequantised values may
differ from bitsandbytes' in the last bits of the scales.
"""

from __future__ import annotations

from typing import Any

from ndparallel.models.adapters import is_peft_model
from ndparallel.models.quantized import NF4Config, quantize_linears

IGNORED = {
    "bnb_4bit_compute_dtype": "compute runs in the run's precision (bf16 with bf16: true / "
    "mixed_precision='bf16', else fp32): the NF4 weight is dequantised to it",
    "bnb_4bit_quant_storage": "FSDP2 shards the NF4 tensor's own packed bytes; no storage dtype is needed",
    "bnb_4bit_use_double_quant": "torchao's NF4 always double-quantises the block scales (as "
    "bnb_4bit_use_double_quant: true)",
    "llm_int8_threshold": "an 8-bit setting: no effect on a 4-bit base",
    "llm_int8_has_fp16_weight": "an 8-bit setting: no effect on a 4-bit base",
    "llm_int8_enable_fp32_cpu_offload": "no device_map offload: FSDP shards the base instead "
    "(fsdp_config.cpu_offload keeps the shards in host memory)",
}
"""Keys accepted with no effect, and why (one ``--dry-run`` note each when set)."""

_INTERNAL = {
    "quant_method",
    "_load_in_4bit",
    "_load_in_8bit",
    "load_in_4bit",
    "load_in_8bit",
    "bnb_4bit_quant_type",
    "llm_int8_skip_modules",
}

LOAD_IN_8BIT_FIX = (
    "an 8-bit base (load_in_8bit) is not supported: use adapter: qlora with "
    "load_in_4bit: true (NF4, half the memory of 8-bit) or adapter: lora with bf16: true"
)


def nf4_config_from_bnb(bnb: dict[str, Any], base: NF4Config = NF4Config()) -> NF4Config:
    """The ``NF4Config`` a bitsandbytes 4-bit config means; ``ValueError`` naming the key and the
    fix for what cannot be honoured (8-bit, fp4, unknown keys)."""
    if bnb.get("load_in_8bit"):
        raise ValueError(LOAD_IN_8BIT_FIX)
    if bnb.get("load_in_4bit") is False:
        raise ValueError(
            "a BitsAndBytesConfig without load_in_4bit=True: give load_in_4bit=True (NF4) or no quantization"
        )
    kind = str(bnb.get("bnb_4bit_quant_type", "nf4")).lower()
    if kind != "nf4":
        raise ValueError(
            f"bnb_4bit_quant_type: {kind!r} is not supported: use 'nf4' (torchao's NF4Tensor; QLoRA's format)"
        )
    unknown = sorted(set(bnb) - set(IGNORED) - _INTERNAL)
    if unknown:
        raise ValueError(
            f"bnb_config_kwargs: {unknown} not supported; known: "
            f"{sorted(set(IGNORED) | {'bnb_4bit_quant_type', 'llm_int8_skip_modules'})}"
        )
    skip = bnb.get("llm_int8_skip_modules") or ()
    if isinstance(skip, str):
        skip = (skip,)
    return NF4Config(base.block_size, base.scaler_block_size, tuple(base.skip_modules) + tuple(skip))


def bnb_notes(bnb: dict[str, Any]) -> list[str]:
    """One line per set key that has no effect here (for ``--dry-run``)."""
    return [f"{key}: {why}" for key, why in IGNORED.items() if bnb.get(key) not in (None, False)]


def as_nf4_config(quantization: Any) -> NF4Config | None:
    """``quantization`` as an ``NF4Config``: None, an ``NF4Config``, ``"nf4"`` / ``"4bit"``, or
    transformers' ``BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4")`` (mapped; the
    rest of a bitsandbytes config is refused by name)."""
    if quantization is None or isinstance(quantization, NF4Config):
        return quantization
    if isinstance(quantization, str):
        if quantization.lower() in ("nf4", "4bit", "load_in_4bit"):
            return NF4Config()
        raise ValueError(f"quantization={quantization!r}: only 'nf4' (a 4-bit NF4 base for QLoRA) exists")
    if type(quantization).__name__ == "BitsAndBytesConfig":
        return nf4_config_from_bnb(quantization.to_dict())
    raise TypeError(
        f"quantization: expected an NF4Config, 'nf4' or a BitsAndBytesConfig, got "
        f"{type(quantization).__name__}"
    )


def quantize_for_qlora(model, quantization: Any) -> list[str]:
    """QLoRA on a model in memory: its base linears become NF4 (``quantize_linears``, each weight
    whole). ``model`` must carry LoRA adapters (a ``PeftModel``): a 4-bit base cannot train."""

    if not is_peft_model(model):
        raise ValueError(
            "quantization (a 4-bit NF4 base) needs adapter= (a LoraConfig) or a PeftModel: the "
            "quantised base is frozen, only adapters train on it (QLoRA)"
        )
    return quantize_linears(model, as_nf4_config(quantization))


def check_quantization(quantization: Any, adapter: Any):
    """``quantization`` as an ``NF4Config`` (None: none); refused without an ``adapter``."""
    quantization = as_nf4_config(quantization)
    if quantization is not None and adapter is None:
        raise ValueError(
            "quantization (a 4-bit NF4 base) needs adapter= (a LoraConfig): the quantised base is "
            "frozen, only adapters train on it (QLoRA)"
        )
    return quantization
