"""Multimodal checkpoints (a text decoder plus vision / audio towers) trained on text, as Axolotl does.

Axolotl fine-tunes the text part of Gemma 3 / 3n / 4, Mistral 3 (Mistral Small 3.x, Medium 3.5),
Voxtral and Qwen 3.5 checkpoints on text data and names their modules as the multimodal class does
(``model.language_model.layers.N.self_attn.q_proj``). ndparallel builds the same class — the
``*ForConditionalGeneration`` class Axolotl loads it with (transformers' image-text-to-text mapping;
Voxtral's own) — so every name in ``lora_target_modules`` / ``unfrozen_parameters`` means the module it means
in
Axolotl, the whole checkpoint loads (towers included) and the export is the checkpoint's own layout.
A text batch runs only the language model: the towers get no gradient and stay as loaded. Cost: the
towers' parameters (frozen, sharded like the rest; e.g. SigLIP ~0.4 B of Gemma 3 27B).

For gemma3 / gemma3n / gemma4 transformers' ``AutoModelForCausalLM`` already maps the multimodal
config to that class; for mistral3 / voxtral it maps nothing, for qwen3_5 the text class (which
would rename the modules). Llama 4 and Qwen 3.5 MoE keep their text class (``Llama4ForCausalLM``,
whose family support is measured; Qwen 3.5 MoE: not measured as multimodal).
"""

from __future__ import annotations

from typing import Any

import torch.nn as nn

TOWERS = ("vision_config", "audio_config")
TRAINED_AS_MULTIMODAL = ("gemma3", "gemma3n", "gemma4", "mistral3", "voxtral", "qwen3_5")
"""Multimodal model types built as their multimodal class (measured in tests/test_multimodal.py, but
gemma3n: its timm vision tower is not installed here). Axolotl builds every model type of
transformers' image-text-to-text mapping (and Voxtral) that way; the others keep what
``AutoModelForCausalLM`` builds (Llama 4 and Qwen 3.5 MoE: their text class) or stay refused."""


def multimodal_class(config: Any) -> type | None:
    """The ``*ForConditionalGeneration`` class a multimodal ``config`` (``text_config`` plus a vision
    or audio config) is trained as — the class Axolotl loads it with (transformers'
    ``AutoModelForImageTextToText``; Voxtral's own) — or None (``AutoModelForCausalLM`` decides)."""
    import transformers
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING,
    )

    kind = getattr(config, "model_type", None)
    if kind not in TRAINED_AS_MULTIMODAL or getattr(config, "text_config", None) is None:
        return None
    if not any(getattr(config, name, None) is not None for name in TOWERS):
        return None
    if kind == "voxtral":
        return transformers.VoxtralForConditionalGeneration
    return MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING.get(type(config), None)


def causal_lm_from_config(config: Any, **kwargs) -> nn.Module:
    """``AutoModelForCausalLM.from_config(config, **kwargs)``, or the multimodal class of a multimodal
    checkpoint's config (``multimodal_class``)."""
    from transformers import AutoModelForCausalLM

    cls = multimodal_class(config)
    if cls is None:
        return AutoModelForCausalLM.from_config(config, **kwargs)
    kwargs.pop("trust_remote_code", None)
    return cls._from_config(config, **kwargs)


TP_FAILS = {  # measured (tests/test_multimodal.py): the multimodal forward under a TP plan
    "gemma4": "its forward mixes the tensor-parallel embedding output with plain tensors (torch.where over "
    "the image / audio token mask)",
    "qwen3_5": "its linear-attention layers (Gated DeltaNet) own parameters the TP plan does not place",
    "qwen3_5_moe": "its linear-attention layers (Gated DeltaNet) own parameters the TP plan does not place",
}


TEXT_TP_FAILS = {
    "qwen3_5_text": TP_FAILS["qwen3_5"],
    "qwen3_5_moe_text": TP_FAILS["qwen3_5_moe"],
    "gemma4_text": TP_FAILS["gemma4"],
}
"""The same models' text-only checkpoints (their text class: the same layers; Gemma 4's text model
fails on the ranks as the multimodal one does: its embedding mixes DTensor and plain tensors)."""


def tensor_parallel_problem(config: Any) -> str | None:
    """Why a multimodal checkpoint (or the text model of one in ``TEXT_TP_FAILS``) cannot train
    under tensor parallelism, or None."""
    model_type = getattr(config, "model_type", None)
    cls = multimodal_class(config)
    if cls is not None:
        reason, what = TP_FAILS.get(model_type), f"{cls.__name__} (a multimodal checkpoint)"
    else:
        reason, what = TEXT_TP_FAILS.get(model_type), f"model_type {model_type!r}"
    if reason is None:
        return None
    return (
        f"{what} cannot train with tensor_parallel_size > 1: {reason}; "
        "use FSDP (dp_shard_size) and data parallelism instead"
    )


def multimodal_note(model: nn.Module) -> str:
    """The ``--dry-run`` note for a model built by ``multimodal_class``."""
    towers = [n.split("_")[0] for n in TOWERS if getattr(model.config, n, None) is not None]
    total = sum(p.numel() for p in model.parameters())
    text = sum(p.numel() for n, p in model.named_parameters() if _is_text(n))
    return (
        f"{type(model).__name__}: a multimodal checkpoint ({' + '.join(towers)}) trained on text as Axolotl "
        "trains it: modules keep the checkpoint's names (model.language_model.*); the towers "
        f"({(total - text) / 1e6:,.2f}M of {total / 1e6:,.2f}M parameters) are loaded, get no gradient and "
        f"are "
        "exported as loaded"
    )


def _is_text(name: str) -> bool:
    return ".language_model." in f".{name}" or name.startswith("lm_head")


def old_layout_hint(targets: Any) -> str | None:
    """For LoRA targets that match nothing: a pattern written with transformers 4's multimodal names
    (``language_model.model.layers``, e.g. Axolotl's Voxtral example), which transformers 5 (and
    Axolotl on it) names ``model.language_model.layers``."""
    if not isinstance(targets, str) or "language_model.model." not in targets:
        return None
    fixed = targets.replace("language_model.model.", "model.language_model.")
    return (
        f"matches no module: transformers 5 names a multimodal model's text layers "
        f"model.language_model.layers.N "
        f"(transformers 4: language_model.model.layers.N); write {fixed!r}"
    )
