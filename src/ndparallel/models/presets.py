"""The one table of named models: tiny built-in ones (quickstart, tests, ``verify``) and the published
shapes of well-known Hugging Face models (planner, ``--dry-run`` of a hub id without network).

Each entry is the set of HF ``config.json`` fields that matter (``model_type`` first): a built-in
preset becomes a plain ``transformers`` config with ``AutoConfig.for_model``, so its model holds no
ndparallel code; the planner reads the same fields (``ndparallel.plan.models.from_hf_config``).
"""

from __future__ import annotations

from typing import Any

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
    # Mixture-of-experts (8 / 4 experts, top-2; the routers' load-balancing loss in the loss).
    "tiny-qwen3-moe": dict(
        model_type="qwen3_moe",
        head_dim=16,
        moe_intermediate_size=32,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        output_router_logits=True,
        router_aux_loss_coef=0.01,
        **_TINY_COMMON,
    ),
    "tiny-mixtral": dict(
        model_type="mixtral",
        sliding_window=None,
        num_local_experts=4,
        num_experts_per_tok=2,
        output_router_logits=True,
        router_aux_loss_coef=0.01,
        **{**_TINY_COMMON, "intermediate_size": 32},
    ),
    # The quickstart's model: still tiny, large enough for the loss to fall visibly on CPU.
    "quickstart-llama": dict(
        model_type="llama",
        **{**_TINY_COMMON, "hidden_size": 128, "intermediate_size": 256, "vocab_size": 1024},
    ),
}
"""Built-in models (random init): ``base_model: tiny-llama`` in YAML, ``acc.load_model("tiny-llama")``."""


def _published(
    model_type: str,
    hidden: int,
    layers: int,
    heads: int,
    kv_heads: int,
    intermediate: int,
    vocab: int,
    head_dim: int,
    tied: bool = False,
    *,
    positions: int,
    **extra: Any,
) -> dict:
    return dict(
        model_type=model_type,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        intermediate_size=intermediate,
        vocab_size=vocab,
        head_dim=head_dim,
        tie_word_embeddings=tied,
        max_position_embeddings=positions,
        **extra,
    )


_LLAMA3_POSITIONS = 131072  # Llama 3.1 / 3.2 config.json (rope_scaling llama3)


PUBLISHED: dict[str, tuple[str, dict[str, Any]]] = {
    # name: (hub id, the shape fields of its published config.json)
    "llama-3.2-1b": (
        "meta-llama/Llama-3.2-1B",
        _published("llama", 2048, 16, 32, 8, 8192, 128256, 64, True, positions=_LLAMA3_POSITIONS),
    ),
    "llama-3.2-3b": (
        "meta-llama/Llama-3.2-3B",
        _published("llama", 3072, 28, 24, 8, 8192, 128256, 128, True, positions=_LLAMA3_POSITIONS),
    ),
    "llama-3.1-8b": (
        "meta-llama/Llama-3.1-8B",
        _published("llama", 4096, 32, 32, 8, 14336, 128256, 128, positions=_LLAMA3_POSITIONS),
    ),
    "llama-3.1-70b": (
        "meta-llama/Llama-3.1-70B",
        _published("llama", 8192, 80, 64, 8, 28672, 128256, 128, positions=_LLAMA3_POSITIONS),
    ),
    "llama-3.1-405b": (
        "meta-llama/Llama-3.1-405B",
        _published("llama", 16384, 126, 128, 8, 53248, 128256, 128, positions=_LLAMA3_POSITIONS),
    ),
    "qwen3-8b": ("Qwen/Qwen3-8B", _published("qwen3", 4096, 36, 32, 8, 12288, 151936, 128, positions=40960)),
    "qwen3-32b": (
        "Qwen/Qwen3-32B",
        _published("qwen3", 5120, 64, 64, 8, 25600, 151936, 128, positions=40960),
    ),
    "mistral-7b": (
        "mistralai/Mistral-7B-v0.3",
        _published("mistral", 4096, 32, 32, 8, 14336, 32768, 128, positions=32768, sliding_window=None),
    ),
    # mixture of experts: every layer routes each token to top-k of E experts
    "qwen3-30b-a3b": (
        "Qwen/Qwen3-30B-A3B",
        _published(
            "qwen3_moe",
            2048,
            48,
            32,
            4,
            6144,
            151936,
            128,
            positions=40960,
            moe_intermediate_size=768,
            num_experts=128,
            num_experts_per_tok=8,
            norm_topk_prob=True,
            router_aux_loss_coef=0.001,
        ),
    ),
    "qwen3-235b-a22b": (
        "Qwen/Qwen3-235B-A22B",
        _published(
            "qwen3_moe",
            4096,
            94,
            64,
            4,
            12288,
            151936,
            128,
            positions=40960,
            moe_intermediate_size=1536,
            num_experts=128,
            num_experts_per_tok=8,
            norm_topk_prob=True,
            router_aux_loss_coef=0.001,
        ),
    ),
    "mixtral-8x7b": (
        "mistralai/Mixtral-8x7B-v0.1",
        _published(
            "mixtral",
            4096,
            32,
            32,
            8,
            14336,
            32000,
            128,
            positions=32768,
            num_local_experts=8,
            num_experts_per_tok=2,
            sliding_window=None,
        ),
    ),
}
"""Well-known models by short name: their hub id and published shape (no weights)."""


def is_preset(name: str) -> bool:
    """True for a built-in (randomly initialised) model name."""
    return name in PRESETS


def preset_config(name: str, **overrides: Any):
    """The HF config of built-in preset ``name`` with ``overrides`` applied (e.g. ``vocab_size``)."""
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; built-in presets: {', '.join(PRESETS)}")
    config = _config_from_fields({**PRESETS[name], **overrides})
    config._attn_implementation = "sdpa"
    return config


def published_config(hub_id_or_name: str):
    """The HF config (shape only) of a well-known model given by hub id or short name, or None."""
    for name, (hub_id, fields) in PUBLISHED.items():
        if hub_id_or_name in (name, hub_id):
            return _config_from_fields(fields)
    return None


def _config_from_fields(fields: dict[str, Any]):
    from transformers import AutoConfig

    kwargs = dict(fields)
    return AutoConfig.for_model(kwargs.pop("model_type"), **kwargs)
