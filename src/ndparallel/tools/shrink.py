"""A shrunk copy of a model config for ``ndparallel verify``: the same architecture and attention
layout with tiny dimensions, so a layout can be checked against one process on CPU in seconds."""

from __future__ import annotations

import copy


def shrink_config(hf_config, tp_size: int, cp_size: int):
    """Same architecture and attention layout, tiny dims: 2 layers, head_dim 8, at most 4 KV heads
    and 4 query heads per KV head, widths and vocab kept divisible by ``tp_size``."""
    c = copy.deepcopy(hf_config)
    heads = c.num_attention_heads
    kv = getattr(c, "num_key_value_heads", None) or heads
    group = max(1, heads // kv)
    new_kv = min(kv, max(4, tp_size))
    if kv % tp_size == 0:  # keep the divisibility the layout relies on
        new_kv = max(tp_size, new_kv - new_kv % tp_size)
    new_heads = new_kv * min(group, 4)
    head_dim = 8
    c.num_attention_heads, c.num_key_value_heads = new_heads, new_kv
    c.head_dim = head_dim
    c.hidden_size = new_heads * head_dim
    c.intermediate_size = 2 * c.hidden_size
    for key in ("moe_intermediate_size", "shared_expert_intermediate_size"):  # MoE: experts stay as many
        if getattr(c, key, None):
            setattr(c, key, c.hidden_size)
    c.num_hidden_layers = 2
    c.vocab_size = 128 * tp_size
    c.max_position_embeddings = max(256, 32 * cp_size)
    if getattr(c, "layer_types", None):
        c.layer_types = c.layer_types[:2]
    c.use_cache = False
    c._attn_implementation = "sdpa"
    return c
