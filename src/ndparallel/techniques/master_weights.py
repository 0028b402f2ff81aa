"""Master weights: the dtype trainable parameters and their optimizer states are kept in (fp32 by
default), whatever dtype the model was loaded in; compute may still run in bf16 (FSDP's mixed
precision). Frozen parameters (e.g. a LoRA base model) keep the dtype they were loaded in: they
get no update, so a higher-precision copy would only cost memory."""

from __future__ import annotations

import torch
import torch.nn as nn


def low_precision_params(model: nn.Module, master_dtype: torch.dtype) -> list[str]:
    """Names of trainable floating-point parameters whose dtype is not ``master_dtype``."""
    return [
        n
        for n, p in model.named_parameters()
        if p.requires_grad and p.is_floating_point() and p.dtype != master_dtype
    ]


def upcast_params(module: nn.Module, dtype: torch.dtype) -> None:
    """Convert ``module``'s trainable floating parameters of another dtype to ``dtype`` in place.
    The Parameter objects (hence ties and references) are kept: ``swap_tensors`` replaces their
    contents, which also works for DTensor parameters (``p.data = ...`` would leave a DTensor's
    local shard behind)."""
    with torch.no_grad():
        for p in module.parameters():
            if p.requires_grad and p.is_floating_point() and p.dtype != dtype:
                torch.utils.swap_tensors(p, nn.Parameter(p.detach().to(dtype), requires_grad=p.requires_grad))
