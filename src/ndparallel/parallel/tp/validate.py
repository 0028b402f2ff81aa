"""Check a model's tensor-parallel dimensions against ``tp_size`` before sharding anything."""

from __future__ import annotations

import math
from typing import Any

from ndparallel.models.multimodal import tensor_parallel_problem
from ndparallel.parallel.options import TPOptions


def validate_tensor_parallel(config: Any, tp_size: int, options: TPOptions | None = None) -> None:
    """Check the model dims that TP shards against ``tp_size``; raise ``ValueError`` naming the field
    and the fix. Fields a user plan does not shard (e.g. no ``lm_head`` entry: vocab) are skipped."""
    if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
        raise ValueError(f"tp_size must be an integer >= 1, got {tp_size!r}")
    if tp_size == 1:
        return

    problem = tensor_parallel_problem(config)
    if problem:
        raise ValueError(problem)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = getattr(text, "num_attention_heads", None)
    fields = {
        "num_attention_heads": heads,
        "num_key_value_heads": getattr(text, "num_key_value_heads", None) or heads,
        "intermediate_size": getattr(text, "intermediate_size", None),
        "vocab_size": getattr(text, "vocab_size", None),
    }
    plan = options.plan if options is not None else None
    if plan:
        names = " ".join(plan)
        wanted = {
            "num_attention_heads": any(k in names for k in ("q_proj", "qkv", "attn", "o_proj")),
            "num_key_value_heads": any(k in names for k in ("k_proj", "v_proj", "qkv", "attn")),
            "intermediate_size": any(k in names for k in ("mlp", "gate", "up_proj", "down_proj", "fc")),
            "vocab_size": any(k in names for k in ("lm_head", "embed")),
        }
        fields = {k: v for k, v in fields.items() if wanted[k]}
    fields = {k: v for k, v in fields.items() if isinstance(v, int) and not isinstance(v, bool)}
    if not fields:
        return
    g = math.gcd(*fields.values())
    allowed = "{" + ",".join(str(d) for d in range(1, g + 1) if g % d == 0) + "}"
    errors = []
    for name, value in fields.items():
        if value % tp_size:
            msg = f"{name}={value} is not divisible by tp_size={tp_size}: use tp_size in {allowed}"
            if name == "vocab_size":
                msg += (
                    f", or pad the vocabulary to a multiple of {tp_size} "
                    f"(model.resize_token_embeddings(n, pad_to_multiple_of={tp_size}))"
                )
            errors.append(msg)
    if errors:
        raise ValueError("; ".join(errors))
