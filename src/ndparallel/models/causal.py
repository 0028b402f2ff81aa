"""Is a model a causal decoder? ndparallel trains next-token prediction, which is only right when
position ``t`` cannot see tokens after ``t``.

Being in transformers' ``AutoModelForCausalLM`` mapping is not enough: ``BertLMHeadModel`` (and
every BERT-like ``*ForCausalLM``) is in it, yet attends both ways unless its config says
``is_decoder: true``. The rule, from what transformers itself declares and does:

1. an encoder-decoder config (``is_encoder_decoder``) or a model type without a causal-LM class
   is refused;
2. transformers' attention modules carry ``is_causal`` (what its SDPA / flash kernels are told).
   Self-attention modules of the language model are those with a boolean ``is_causal`` outside
   cross-attention (``encoder_attn``, ``crossattention``, ...) and outside vision / audio towers.
   If there are some and **every one** says ``False``, the model is bidirectional (BERT-likes
   without ``is_decoder``, Gemma-3 with ``use_bidirectional_attention``) — unless a forward pass
   of a shrunk copy proves otherwise (a few causal models build their mask elsewhere and leave
   ``is_causal`` at ``False``): the logits before the last position must not change when the
   last token does;
3. models without such attributes (RNN/SSM families, older GPT-style code) are accepted.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from ndparallel.models.multimodal import causal_lm_from_config, multimodal_class

_CROSS = ("encoder_attn", "crossattention", "cross_attn", "cross_attention", "encoder_attention")
_TOWERS = ("vision", "visual", "audio", "image", "speech")
_LAYER_COUNTS = ("num_hidden_layers", "num_layers", "n_layer", "n_layers", "decoder_layers", "encoder_layers")


def config_problem(config: Any, trust_remote_code: bool = False) -> str | None:
    """Why ``config`` cannot be trained as a causal LM (from the config alone), or None."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    kind = f"model_type {config.model_type!r} (architectures {getattr(config, 'architectures', None)})"
    if getattr(config, "is_encoder_decoder", False):
        return (
            f"{kind} is an encoder-decoder (is_encoder_decoder: true): ndparallel trains causal decoders only"
        )
    if type(config) in MODEL_FOR_CAUSAL_LM_MAPPING or multimodal_class(config) is not None:
        return None
    if trust_remote_code and "AutoModelForCausalLM" in (getattr(config, "auto_map", None) or {}):
        return None
    return (
        f"{kind} has no causal-LM class in transformers' AutoModelForCausalLM; ndparallel trains "
        "causal language models only"
        + ("" if trust_remote_code else " (for custom code models set trust_remote_code: true)")
    )


def self_attention_flags(model: torch.nn.Module) -> list[tuple[str, bool]]:
    """``(module name, is_causal)`` of the language model's self-attention modules."""
    flags = []
    for name, module in model.named_modules():
        flag = getattr(module, "is_causal", None)
        if not isinstance(flag, bool) or getattr(module, "is_cross_attention", False):
            continue
        parts = name.split(".")
        if parts[-1] in _CROSS or any(p.startswith(_TOWERS) for p in parts):
            continue
        flags.append((name, flag))
    return flags


def causal_lm_problem(model: torch.nn.Module) -> str | None:
    """Why ``model`` (any device, meta included) is not a causal decoder, or None."""
    flags = self_attention_flags(model)
    if not flags or any(flag for _, flag in flags):
        return None
    config = model.config
    if future_visible(config) is False:
        return None
    hint = (
        "; if it is meant as a decoder, set is_decoder: true in its config.json (its "
        "self-attention is then causal)"
        if hasattr(config, "is_decoder")
        else ""
    )
    return (
        f"{type(model).__name__} is not a causal decoder: its self-attention is bidirectional "
        f"(every self-attention module has is_causal=False, e.g. {flags[0][0]!r}; is_decoder="
        f"{getattr(config, 'is_decoder', None)}), so a next-token objective would see the "
        f"tokens it predicts{hint}"
    )


def future_visible(config: Any, length: int = 8) -> bool | None:
    """Whether logits at positions ``< length - 1`` of a shrunk random copy change when only the
    last token changes (True: the model sees the future). None when the copy cannot be built or
    run (the attribute evidence then stands)."""

    small = copy.deepcopy(config)
    for key in _LAYER_COUNTS:
        if isinstance(getattr(small, key, None), int):
            setattr(small, key, min(getattr(small, key), 2))
    vocab = getattr(small, "vocab_size", None)
    if isinstance(vocab, int):
        small.vocab_size = min(vocab, 1024)
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            model = causal_lm_from_config(small).eval()
            ids = torch.randint(4, 100, (1, length))
            changed = ids.clone()
            changed[0, -1] = 3 if ids[0, -1] != 3 else 2
            with torch.no_grad():
                a = model(input_ids=ids).logits[:, :-1]
                b = model(input_ids=changed).logits[:, :-1]
    except Exception:  # noqa: BLE001 - any failure: no behavioural evidence
        return None
    return not torch.allclose(a, b, atol=1e-6, rtol=0)


def learned_position_tables(model: torch.nn.Module, positions: int) -> list[str]:
    """Embedding tables of absolute positions (GPT-2's ``wpe``, OPT's ``embed_positions``): modules
    other than the input embedding with ``positions`` (OPT: + 2) rows. Such a model cannot run past
    ``positions``; rotary and ALiBi models compute positions and can (extrapolating)."""
    inputs = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    return [
        name
        for name, m in model.named_modules()
        if isinstance(m, torch.nn.Embedding)
        and m is not inputs
        and positions <= m.num_embeddings <= positions + 2
    ]
