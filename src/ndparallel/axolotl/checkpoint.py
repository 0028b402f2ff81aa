"""Axolotl's keys for checkpoint formats the loader reads (``models/checkpoint_formats.py``):
``model_quantization_config: Mxfp4Config`` with ``model_quantization_config_kwargs: {dequantize:
true}`` (gpt-oss published in MXFP4, trained dequantised) and ``llama4_linearized_experts: true``
(Axolotl's per-expert-linear Llama 4 checkpoints). Value mappers of ``translate.MAPPERS``."""

from __future__ import annotations

import re
from typing import Any

from ndparallel.axolotl.keys import Translation, is_empty

MXFP4_NOTE = (
    "the checkpoint's MXFP4 expert weights (*_blocks + *_scales) are dequantised on load to the run's "
    "dtype, exactly, each rank only its experts; the model trains and is saved unquantised (a bf16 "
    "checkpoint loads unchanged)"
)
MXFP4_FIX = (
    "an MXFP4 base is not trained as it is here: set model_quantization_config_kwargs: {dequantize: true} "
    "(the experts dequantised on load, as Axolotl's gpt-oss examples train)"
)
LINEARIZED_NOTE = (
    "the checkpoint's per-expert linears (experts.gate_projs / up_projs / down_projs) are fused "
    "into transformers' Llama 4 experts on load (the same model); saved in transformers' layout"
)
LINEARIZED_LORA_FIX = (
    "Axolotl's linearized expert linears are fused into transformers' 3-D expert weights "
    "(experts.gate_up_proj / down_proj), which LoRA cannot target: remove these entries "
    "(LoRA on attention and shared_expert as listed trains)"
)
_EXPERT_LINEARS = re.compile(r"experts\.(gate|up|down)_projs")
_KWARGS = "model_quantization_config_kwargs"


def model_quantization(t: Translation, key: str, value: Any) -> None:
    """``model_quantization_config`` and its ``_kwargs``, read together by whichever comes first
    (the partner's value is then set to None in ``t.data``, so its own turn does nothing)."""
    if is_empty(value):
        return
    partner = _KWARGS if key == "model_quantization_config" else "model_quantization_config"
    other = t.data.get(partner)
    if partner in t.data:
        t.data[partner] = None
    config, kwargs = (value, other) if key == "model_quantization_config" else (other, value)
    if is_empty(config):
        t.refuse(_KWARGS, kwargs, "given without model_quantization_config: remove it")
    elif str(config).lower() not in ("mxfp4config", "mxfp4"):
        t.refuse(
            "model_quantization_config",
            config,
            "only Mxfp4Config (with dequantize: true) is read here; "
            "remove it (a 4-bit NF4 base: adapter: qlora + load_in_4bit: true; a bf16 base: bf16: true)",
        )
    elif not isinstance(kwargs, dict) or kwargs.get("dequantize") is not True:
        t.refuse(_KWARGS if kwargs else "model_quantization_config", kwargs or config, MXFP4_FIX)
    elif set(kwargs) - {"dequantize"}:
        t.refuse(
            _KWARGS,
            sorted(set(kwargs) - {"dequantize"}),
            "only dequantize: true is understood; remove the rest",
        )
    else:
        t.notes.append(f"model_quantization_config: {config} + dequantize: true -> {MXFP4_NOTE}")


def linearized_experts(t: Translation, key: str, value: Any) -> None:
    if is_empty(value):
        return
    targets = t.data.get("lora_target_modules") or []
    targets = [targets] if isinstance(targets, str) else targets
    experts = [m for m in targets if isinstance(m, str) and _EXPERT_LINEARS.search(m)]
    if experts:
        t.refuse("lora_target_modules", experts, LINEARIZED_LORA_FIX)
    t.notes.append(f"{key}: true -> {LINEARIZED_NOTE}")
