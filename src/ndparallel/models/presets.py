"""Built-in model configs: tiny ones for the quickstart, tests and ``verify``.

A preset is a name for an HF config; it is built with ``AutoConfig.for_model`` so the model is a
plain ``transformers`` model with no ndparallel code in it.
"""

from __future__ import annotations

from typing import Any

from transformers import AutoConfig, PretrainedConfig

_TINY_COMMON: dict[str, Any] = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=4096,
    vocab_size=256,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
    attention_dropout=0.0,
)

PRESETS: dict[str, dict[str, Any]] = {
    "tiny-llama": dict(model_type="llama", **_TINY_COMMON),
    "tiny-llama-tied": dict(model_type="llama", **{**_TINY_COMMON, "tie_word_embeddings": True}),
    "tiny-qwen2": dict(model_type="qwen2", **_TINY_COMMON),
    "tiny-qwen3": dict(model_type="qwen3", head_dim=16, **{**_TINY_COMMON, "tie_word_embeddings": True}),
    "tiny-mistral": dict(model_type="mistral", sliding_window=None, **_TINY_COMMON),
    # The quickstart's model: still tiny, large enough for the loss to fall visibly on CPU.
    "quickstart-llama": dict(
        model_type="llama",
        **{**_TINY_COMMON, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1024},
    ),
}


def is_preset(name: str) -> bool:
    return name in PRESETS


def preset_config(name: str, **overrides: Any) -> PretrainedConfig:
    """The HF config of preset ``name`` with ``overrides`` applied (e.g. ``vocab_size``)."""
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; built-in presets: {', '.join(PRESETS)}")
    kwargs = {**PRESETS[name], **overrides}
    model_type = kwargs.pop("model_type")
    config = AutoConfig.for_model(model_type, **kwargs)
    config._attn_implementation = "sdpa"
    return config
