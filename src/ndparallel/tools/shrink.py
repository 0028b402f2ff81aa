"""A shrunk copy of a model config (``ndparallel verify``, the pre-launch check of a family outside
the tested set, the family matrix of the tests): the same architecture and attention layout with
tiny dimensions, so a layout can be checked against one process on CPU in seconds.

What is kept, per family, from the config's own fields (no table of families):

* attention: the head/KV-head ratio, a query/key head dim unlike the value one (MLA), biases, norms;
* every layer kind in two layers: a sliding-window and a full layer (Gemma 2/3, Cohere 2, ...), a
  chunked and a NoPE layer (Llama 4); windows and attention chunks shrunk below the sequence so
  that they bite (a window of 5, chunks of 6 tokens);
* a mixture of experts: a dense first layer where the family has one and an MoE layer, ≤ 4 experts
  (or ``ep_size``: as many as the expert-parallel degree needs), ≤ 2 per token;
* soft-capping, partial rotary dims (rope lists sliced to the new head dim), tied embeddings;
* per-layer overrides of a heterogeneous config (Gemma 4's full-attention layers: a head dim twice
  the sliding ones'), shrunk by the same ratio, per layer kind; Gemma 4's per-layer input embeddings
  at the small width and vocabulary, no KV sharing between the two layers;
* every divisibility the layout needs (heads, KV heads, widths and vocabulary by ``tp_size``).

Dropout is set to 0 (its random masks differ per layout) and token ids outside the shrunk
vocabulary are dropped. ``attn_implementation`` is the family's own choice on one process (sdpa
where transformers supports it for the family, else eager: Gemma 2's soft-capping).
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

WINDOW = 5
"""Sliding window of a shrunk model: shorter than a CP chunk of verify's rows, so windows cut
across chunks and ranks."""
CHUNK = 6
"""Attention chunk of a shrunk chunked-attention layer (Llama 4)."""
HEAD_DIM = 8


@dataclass(frozen=True)
class ShrunkModel:
    config: object  # a transformers PretrainedConfig, ``_attn_implementation`` set
    attn_implementation: str


def _set(c, name: str, value) -> None:
    """Set a config field if the config has it (and it is not a read-only property)."""
    if name in c.to_dict() and not isinstance(getattr(type(c), name, None), property):
        setattr(c, name, value)


def _heads(c, tp_size: int, cp_size: int) -> tuple[int, int]:
    """(query heads, KV heads): grouped-query attention stays grouped (≤ 2 query heads per KV head
    at the small size), the KV heads stay divisible by ``tp_size`` where they were, and the query
    heads per TP rank divide over ``cp_size`` (all-to-all CP splits them)."""
    heads = c.num_attention_heads
    kv = getattr(c, "num_key_value_heads", None) or heads
    group = max(1, heads // kv)
    new_kv = min(kv, max(2, tp_size))
    if kv % tp_size == 0:  # keep the divisibility the layout relies on
        new_kv = max(tp_size, new_kv - new_kv % tp_size)
    heads = math.lcm(new_kv * min(group, 2), tp_size * cp_size)
    return (heads, heads) if group == 1 else (heads, new_kv)  # multi-head attention stays so


def _layer_kinds(c) -> None:
    """Two layers holding every kind the config has (first two distinct kinds)."""
    types = list(getattr(c, "layer_types", None) or ())
    kinds = list(dict.fromkeys(types))
    if "chunked_attention" in kinds and hasattr(c, "no_rope_layers"):  # Llama 4: a chunked RoPE layer
        c.no_rope_layers, kinds = [1, 0], ["chunked_attention", "full_attention"]  # and a NoPE one
    if types:
        c.layer_types = (kinds * 2)[:2]
    if (
        any(t == "sliding_attention" for t in c.layer_types or ())
        if types
        else (getattr(c, "sliding_window", None) and getattr(c, "use_sliding_window", True))
    ):
        c.sliding_window = WINDOW
    if "chunked_attention" in kinds:
        c.attention_chunk_size = CHUNK


def _experts(c, ep_size: int = 1) -> None:
    keep = ep_size * max(1, 4 // ep_size)  # 4, or a multiple of ep_size (which divides the original count)
    for name in ("num_experts", "num_local_experts", "n_routed_experts"):
        if getattr(c, name, None):
            setattr(c, name, min(getattr(c, name), keep))
    for name in ("num_experts_per_tok", "top_k_experts"):
        if getattr(c, name, None):
            setattr(c, name, min(getattr(c, name), 2))
    for name, value in (
        ("n_group", 1),
        ("topk_group", 1),
        ("first_k_dense_replace", 1),
        ("decoder_sparse_step", 1),
        ("mlp_only_layers", []),
    ):
        _set(c, name, value)
    if getattr(c, "moe_layers", None):
        c.moe_layers = [1]


def _widths(c, hidden: int, tp_size: int) -> None:
    c.hidden_size = hidden
    for name, value in (
        ("intermediate_size", 2 * hidden),
        ("intermediate_size_mlp", 2 * hidden),
        ("ffn_hidden_size", 2 * hidden),
        ("moe_intermediate_size", 4 * tp_size),
        ("shared_expert_intermediate_size", 8 * tp_size),
    ):
        if getattr(c, name, None):
            _set(c, name, value)
    if getattr(c, "kv_lora_rank", None):  # MLA (DeepSeek-V3): value head dim ≠ query/key head dim
        c.kv_lora_rank, c.qk_rope_head_dim, c.qk_nope_head_dim = 16, HEAD_DIM, HEAD_DIM
        c.v_head_dim = 12
        _set(c, "qk_head_dim", 2 * HEAD_DIM)
        if getattr(c, "q_lora_rank", None):
            c.q_lora_rank = 32


def _rope_lists(c, old_dim: int, new_dim: int) -> None:
    """Per-frequency rope lists (Phi-3's longrope factors) cut to the new head dim."""
    params = getattr(c, "rope_parameters", None) or getattr(c, "rope_scaling", None)
    for table in [params] if isinstance(params, dict) else []:
        for sub in [table, *(v for v in table.values() if isinstance(v, dict))]:
            for key, value in list(sub.items()):
                if isinstance(value, list) and value and len(value) * 2 >= new_dim and old_dim != new_dim:
                    sub[key] = value[: max(1, len(value) * new_dim // old_dim)]


def _clean(c, vocab: int, max_positions: int) -> None:
    for name in ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id"):
        value = getattr(c, name, None)
        if (
            isinstance(value, int)
            and value >= vocab
            or isinstance(value, list)
            and any(v >= vocab for v in value)
        ):
            setattr(c, name, None)
    for name, value in c.to_dict().items():
        if isinstance(value, float) and value and ("dropout" in name or name.endswith("_pdrop")):
            _set(c, name, 0.0)
    c.max_position_embeddings = max(getattr(c, "max_position_embeddings", 0) and 256, max_positions)
    _set(
        c,
        "original_max_position_embeddings",
        min(getattr(c, "original_max_position_embeddings", 0) or 0, c.max_position_embeddings) or None,
    )


def attention_choice(config) -> str:
    """What one process runs for this family: sdpa where transformers supports it, else eager."""
    from transformers import AutoModelForCausalLM

    cls = AutoModelForCausalLM._model_mapping.get(type(config), None)
    return "sdpa" if cls is None or getattr(cls, "_supports_sdpa", True) else "eager"


def _homogeneous(c):
    """(``c`` without per-layer overrides, the overrides by layer index): a heterogeneous config
    (transformers' ``per_layer_config``) refuses reading per-layer fields globally."""
    spec = c.__dict__.get("_heterogeneity_spec")
    overrides = dict(spec.per_layer_overrides) if spec is not None else {}
    if not overrides:
        return c, {}
    return type(c)(**{**c.to_dict(), "per_layer_config": {}}), overrides


def _shrunk_overrides(overrides: dict, old_types: list, new_types: list, old_dim: int, kv: int) -> dict:
    """The per-layer overrides for the two shrunk layers: each layer kind keeps its kind's override,
    a head dim scaled by HEAD_DIM / old_dim, KV heads at the shrunk count."""

    def shrunk(o: dict) -> dict:
        return {
            k: (
                max(HEAD_DIM, HEAD_DIM * v // old_dim)
                if k == "head_dim"
                else kv
                if k == "num_key_value_heads"
                else v
            )
            for k, v in o.items()
        }

    if not old_types or not new_types:
        return {1: shrunk(next(iter(overrides.values())))}
    by_kind = {old_types[i]: o for i, o in sorted(overrides.items())}
    return {i: shrunk(by_kind[t]) for i, t in enumerate(new_types) if by_kind.get(t)}


def shrink_model(hf_config, tp_size: int, cp_size: int, ep_size: int = 1) -> ShrunkModel:
    """``hf_config`` shrunk (see the module doc), checked by building it on the meta device."""
    c = copy.deepcopy(hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config)
    c, overrides = _homogeneous(c)
    old_types = list(getattr(c, "layer_types", None) or ())
    old_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    heads, kv = _heads(c, tp_size, cp_size)
    c.num_attention_heads = heads
    _set(c, "num_key_value_heads", kv)
    _set(c, "num_kv_heads", kv)
    _set(c, "head_dim", HEAD_DIM)
    _widths(c, heads * HEAD_DIM, tp_size)
    if getattr(c, "query_pre_attn_scalar", None):
        c.query_pre_attn_scalar = HEAD_DIM
    c.num_hidden_layers = 2
    c.vocab_size = 128 * tp_size
    _layer_kinds(c)
    _experts(c, ep_size)
    _rope_lists(c, old_dim, HEAD_DIM)
    _clean(c, c.vocab_size, 32 * cp_size)
    if getattr(c, "hidden_size_per_layer_input", None):  # Gemma 4's per-layer input embeddings
        c.hidden_size_per_layer_input, c.vocab_size_per_layer_input = HEAD_DIM, c.vocab_size
    _set(c, "num_kv_shared_layers", 0)  # two layers: no later layer to reuse an earlier one's K/V
    if overrides:
        c = type(c)(
            **{
                **c.to_dict(),
                "per_layer_config": _shrunk_overrides(
                    overrides, old_types, list(getattr(c, "layer_types", None) or ()), old_dim, kv
                ),
            }
        )
    c.use_cache = False
    attn = attention_choice(c)
    c._attn_implementation = attn
    return ShrunkModel(c, attn)


def shrink_config(hf_config, tp_size: int, cp_size: int, ep_size: int = 1):
    """The shrunk config alone (``shrink_model``), its attention implementation set."""
    return shrink_model(hf_config, tp_size, cp_size, ep_size).config
