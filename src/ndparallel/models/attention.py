"""Which attention kernel a model gets on this machine: the one asked for, or sdpa when it cannot
run here (a flash-attention kernel without a CUDA GPU or without its package)."""

from __future__ import annotations

import importlib.util

_PACKAGES = {"flash_attention_2": "flash_attn", "flash_attention_3": "flash_attn_interface"}


def attention_kernel(name: str | None, device_type: str) -> tuple[str | None, str | None]:
    """``(kernel to use, why the requested one is not used or None)``; ``None`` asks for the
    family's own choice (transformers': sdpa where it supports it for the family, else eager —
    Gemma 2's soft-capping) and is returned as None."""
    if name in (None, "sdpa", "eager"):
        return name, None
    if name in _PACKAGES or name == "flex_attention":
        if device_type != "cuda":
            return "sdpa", f"it needs a CUDA GPU, this run is on {device_type}"
        package = _PACKAGES.get(name)
        if package and importlib.util.find_spec(package) is None:
            return "sdpa", f"the {package} package is not installed"
    return name, None
