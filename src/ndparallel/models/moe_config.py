"""How many routed experts an HF config declares: config knowledge only, no torch import (the
planner reads it; ``ndparallel plan`` starts without torch)."""

from __future__ import annotations

from typing import Any

_EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")


def config_num_experts(config: Any) -> int | None:
    """Routed experts per MoE layer from an HF config (or its dict), None for a dense model."""
    get = config.get if isinstance(config, dict) else lambda k, d=None: getattr(config, k, d)
    text = config.get_text_config() if hasattr(config, "get_text_config") else None
    if text is not None and text is not config:
        return config_num_experts(text)
    for key in _EXPERT_COUNT_KEYS:
        value = get(key, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 1:
            return value
    return None
