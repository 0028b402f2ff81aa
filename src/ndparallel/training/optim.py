"""The optimizer and learning-rate schedule of a run (``ndparallel train`` and the equivalence checks).

Weight decay follows Hugging Face's Trainer: it applies to matrices (linear and embedding weights)
and not to 1-D parameters (norm weights, biases), whose decay would only pull them towards 0.
"""

from __future__ import annotations

from typing import Iterable

import torch


def parameter_groups(params: Iterable[torch.nn.Parameter], weight_decay: float) -> list[dict]:
    """Two optimizer groups: ≥ 2-D parameters with ``weight_decay``, 1-D ones without."""
    unique = list({id(p): p for p in params if p.requires_grad}.values())
    decay = [p for p in unique if p.ndim >= 2]
    no_decay = [p for p in unique if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": weight_decay}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return groups


def fused_supported(params: list[torch.Tensor]) -> bool:
    """torch's fused AdamW kernel applies: every parameter a floating-point CUDA tensor (DTensors
    included: DTensor shards ``_fused_adamw_`` like a pointwise list op; tested under FSDP × TP)."""
    return bool(params) and all(p.device.type == "cuda" and p.is_floating_point() for p in params)


def build_optimizer(
    params: Iterable[torch.nn.Parameter] | torch.nn.Module, name: str = "adamw", lr: float = 3e-4,
    weight_decay: float = 0.0, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
    fused: bool | None = None,
) -> torch.optim.Optimizer:
    """``adamw`` (alias ``adamw_torch``) or ``sgd`` over ``params`` with the weight-decay groups above.
    AdamW is ``fused`` (one kernel for all parameters, step count on the device: no host sync)
    by default when every parameter is on CUDA (``fused_supported``); torch's default otherwise.
    Low-bit AdamW names (``adamw_8bit``, ``adamw_torch_4bit``, ...): torchao's (``optim_lowbit``);
    given the model (``params`` a module), its token embeddings keep fp32 states there."""
    from ndparallel.training.optim_lowbit import (
        ALIASES,
        build_low_bit,
        embedding_groups,
        is_low_bit,
    )

    model = params if isinstance(params, torch.nn.Module) else None
    groups = parameter_groups(model.parameters() if model is not None else params, weight_decay)
    name = ALIASES.get(name, name)
    if is_low_bit(name):
        embeddings = {id(m.weight) for m in (model.modules() if model is not None else ())
                      if isinstance(m, torch.nn.Embedding)}
        return build_low_bit(name, embedding_groups(groups, embeddings), lr, betas, eps)
    if name == "sgd":
        return torch.optim.SGD(groups, lr=lr)
    if name in ("adamw", "adamw_torch", "adamw_torch_fused"):  # fused wherever it applies
        all_params = [p for g in groups for p in g["params"]]
        use_fused = fused_supported(all_params) if fused is None else fused
        return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, fused=use_fused or None)
    raise ValueError(f"optimizer {name!r} is not supported: use 'adamw', 'sgd' or 'adamw_8bit'")


SCHEDULERS = {"cosine": "cosine", "linear": "linear", "constant": "constant_with_warmup",
              "constant_with_warmup": "constant_with_warmup"}
"""Our YAML names -> transformers' ``get_scheduler`` names."""


def build_scheduler(optimizer: torch.optim.Optimizer, name: str, warmup_steps: int, total_steps: int):
    """transformers' schedule ``name`` (see ``SCHEDULERS``) with linear warm-up."""
    from transformers import get_scheduler

    return get_scheduler(SCHEDULERS[name], optimizer, num_warmup_steps=warmup_steps,
                         num_training_steps=total_steps)
