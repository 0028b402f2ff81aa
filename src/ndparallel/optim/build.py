"""The optimizer and learning-rate schedule of a run (``ndparallel train`` and the equivalence checks).

Weight decay follows Hugging Face's Trainer: it applies to matrices (linear and embedding weights)
and not to 1-D parameters (norm weights, biases), whose decay would only pull them towards 0.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from ndparallel.optim.lowbit import build_low_bit, embedding_groups
from ndparallel.optim.names import ALIASES, is_low_bit


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
    params: Iterable[torch.nn.Parameter] | torch.nn.Module,
    name: str = "adamw",
    lr: float = 3e-4,
    weight_decay: float = 0.0,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    fused: bool | None = None,
    **options,
) -> torch.optim.Optimizer:
    """``adamw`` (alias ``adamw_torch``) or ``sgd`` over ``params`` with the weight-decay groups above.
    AdamW is ``fused`` (one kernel for all parameters, step count on the device: no host sync)
    by default when every parameter is on CUDA (``fused_supported``); torch's default otherwise.
    Low-bit AdamW names (``adamw_8bit``, ``adamw_torch_4bit``, ...): torchao's (``optim_lowbit``);
    given the model (``params`` a module), its token embeddings keep fp32 states there.
    ``muon``: Muon for the hidden matrices, AdamW for the rest (``optim_muon``; needs the model;
    ``options``: ``MuonAdamW``'s keywords)."""

    model = params if isinstance(params, torch.nn.Module) else None
    if name == "muon":
        from ndparallel.optim.muon import build_muon

        if model is None:
            raise ValueError(
                "optimizer 'muon' needs the model (build_optimizer(model, 'muon')): it sends the "
                "embeddings and LM head to AdamW"
            )
        return build_muon(model, lr, weight_decay, betas, eps, **options)
    groups = parameter_groups(model.parameters() if model is not None else params, weight_decay)
    name = ALIASES.get(name, name)
    if is_low_bit(name):
        embeddings = {
            id(m.weight)
            for m in (model.modules() if model is not None else ())
            if isinstance(m, torch.nn.Embedding)
        }
        return build_low_bit(name, embedding_groups(groups, embeddings), lr, betas, eps)
    if name == "sgd":
        return torch.optim.SGD(groups, lr=lr)
    if name in ("adamw", "adamw_torch", "adamw_torch_fused"):  # fused wherever it applies
        all_params = [p for g in groups for p in g["params"]]
        use_fused = fused_supported(all_params) if fused is None else fused
        return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, fused=use_fused or None)
    raise ValueError(f"optimizer {name!r} is not supported: use 'adamw', 'sgd', 'muon' or 'adamw_8bit'")


SCHEDULERS = {
    "cosine": "cosine",
    "linear": "linear",
    "constant": "constant_with_warmup",
    "constant_with_warmup": "constant_with_warmup",
}
"""Our YAML names -> transformers' ``get_scheduler`` names."""


def build_scheduler(
    optimizer: torch.optim.Optimizer,
    name: str,
    warmup_steps: int,
    total_steps: int,
    min_lr_ratio: float | None = None,
    constant_lr_ratio: float | None = None,
    quadratic_warmup: bool = False,
):
    """transformers' schedule ``name`` (see ``SCHEDULERS``) with linear warm-up; a cosine with
    Axolotl's options (``cosine_min_lr_ratio``, ``cosine_constant_lr_ratio``,
    ``lr_quadratic_warmup``) is ``cosine_factor``."""
    from transformers import get_scheduler

    if name == "cosine" and (min_lr_ratio is not None or constant_lr_ratio is not None or quadratic_warmup):
        import functools

        return torch.optim.lr_scheduler.LambdaLR(
            optimizer,
            functools.partial(
                cosine_factor,
                warmup_steps=warmup_steps,
                total_steps=total_steps,
                min_lr_ratio=min_lr_ratio or 0.0,
                constant_lr_ratio=constant_lr_ratio,
                quadratic_warmup=quadratic_warmup,
            ),
        )
    return get_scheduler(
        SCHEDULERS[name], optimizer, num_warmup_steps=warmup_steps, num_training_steps=total_steps
    )


def cosine_factor(
    step: int,
    *,
    warmup_steps: int,
    total_steps: int,
    min_lr_ratio: float = 0.0,
    constant_lr_ratio: float | None = None,
    quadratic_warmup: bool = False,
) -> float:
    """The learning-rate factor at ``step``: warm-up (linear, or quadratic) to 1, then a half cosine
    down to ``min_lr_ratio`` reached at the end — or at ``constant_lr_ratio`` of the steps, after
    which it stays there."""
    if step < warmup_steps:
        ramp = step / max(1, warmup_steps)
        return ramp * ramp if quadratic_warmup else ramp
    end = (
        total_steps if constant_lr_ratio is None else max(warmup_steps, int(total_steps * constant_lr_ratio))
    )
    progress = min(1.0, (min(step, end) - warmup_steps) / max(1, end - warmup_steps))
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))
