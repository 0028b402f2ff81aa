"""The one training step: micro-batches (CP-sharded), gradient accumulation, the layout-invariant
loss, clipping, the non-finite guard, the optimizer and scheduler, fp8 scale precomputation, QAT's
delayed fake quantisation (``fake_quant_after_n_steps``).
``ndparallel train``, ``ndparallel verify`` and the equivalence checks all run this function, so
what verify proves is what train runs.

The step never waits for the device: the token count and the loss stay device tensors, nothing
is read back (``tests/test_host_sync.py`` counts the reads)."""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import get_args

import torch

from ndparallel.parallel.fsdp import set_gradient_sync
from ndparallel.techniques.float8 import precompute_scales
from ndparallel.techniques.qat import step_fake_quant
from ndparallel.techniques.technique_options import PIPELINE_MICRO_BATCH_MEAN, LossReduction


@dataclass
class StepResult:
    loss: torch.Tensor
    """The global mean token loss of the step (under ``loss_reduction: micro_batch_mean`` the mean of
    the micro-batches' means; a device scalar, the same on every rank)."""
    grad_norm: torch.Tensor
    """The global gradient norm before clipping (a device scalar)."""
    aux_loss: torch.Tensor | None = None
    """A mixture-of-experts model's load-balancing loss of the step (unscaled by its coefficient;
    the mean over the micro-batches, each over its global micro-batch), included in ``loss``
    × ``router_aux_loss_coef``; None when the model adds none."""


def batch_to_device(batch: Mapping[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """Copy a host batch to ``device``: through pinned memory and without blocking the host on
    CUDA (the copy is queued before the step's kernels that read it); as is on CPU."""
    if device.type != "cuda":
        return {k: v.to(device) for k, v in batch.items()}
    return {k: v.pin_memory().to(device, non_blocking=True) for k, v in batch.items()}


def forward_backward(
    engine,
    model: torch.nn.Module,
    micro_batches: Sequence[Mapping[str, torch.Tensor]],
    aux_values: list | None = None,
    loss_scale: float | None = None,
    loss_reduction: LossReduction = "global_token_mean",
) -> torch.Tensor:
    """Run every micro-batch (CP-sharded when CP is on) with the layout-invariant loss and
    back-propagate it; gradients are reduced after the last micro-batch only (accumulation).
    Returns this rank's share of the step loss (a device tensor): summed over the ``dp_cp`` ranks
    it is the global mean token loss. ``aux_values`` collects a
    mixture-of-experts model's load-balancing loss of each micro-batch (already / their number).
    ``loss_scale`` (fp16): back-propagate the loss × it (the returned loss is not scaled).
    ``loss_reduction: micro_batch_mean``: the mean of the dp ranks' micro-batches' own token means
    instead (Axolotl's; under pipeline parallel only with one micro-batch per step)."""

    if loss_reduction == "micro_batch_mean":
        n_items = engine.micro_batch_num_items(micro_batches)
    elif loss_reduction == "global_token_mean":
        n_items = [engine.global_num_items(micro_batches)]
    else:
        raise ValueError(f"loss_reduction: {loss_reduction!r} is none of {get_args(LossReduction)}")
    pipeline = engine.pipeline_of(model)
    if pipeline is not None:  # the schedule runs every micro-batch through the stages, one divisor
        if len(n_items) > 1:
            raise ValueError(PIPELINE_MICRO_BATCH_MEAN)
        return pipeline.forward_backward(micro_batches, n_items[0], loss_scale)
    if len(n_items) == 1:  # one divisor for every micro-batch
        n_items = n_items * len(micro_batches)
    loss_sum = torch.zeros((), device=engine.device)
    try:
        for i, mb in enumerate(micro_batches):
            engine.set_grad_sync(model, i == len(micro_batches) - 1)
            with engine.batch_context(mb):
                loss = engine.forward_loss(
                    model, mb, n_items[i], aux_weight=1.0 / len(micro_batches), aux_values=aux_values
                )
                engine.backward(loss * loss_scale if loss_scale is not None else loss, model)
            loss_sum += loss.detach().float()
    finally:
        set_gradient_sync(model, True)
    return loss_sum


def train_step(
    engine,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    micro_batches: Sequence[Mapping[str, torch.Tensor]],
    *,
    scheduler=None,
    max_grad_norm: float | None = None,
    guard=None,
    step: int = 0,
    scaler=None,
    loss_reduction: LossReduction = "global_token_mean",
) -> StepResult:
    """One optimizer step over ``micro_batches`` (this rank's, already on the device).

    ``max_grad_norm``: clip to it (None: only measure the norm). ``guard``: a ``NonFiniteGuard``
    deciding whether a non-finite step is applied (``step`` is its 1-based index). The scheduler
    steps even when the optimizer step is skipped (the schedule follows the step count).
    ``scaler``: a ``LossScaler`` (fp16): the loss is scaled, the gradients unscaled before clipping,
    and an overflow (non-finite global norm: the same decision on every rank) skips the optimizer
    step and backs off the scale; the guard then sees only the loss (an overflow is no divergence).
    ``loss_reduction``: the YAML's (``forward_backward``)."""
    aux_values: list = []
    if engine.options.qat.fake_quant_after_n_steps is not None:
        step_fake_quant(model, engine.options.qat, step)
    loss = forward_backward(
        engine,
        model,
        micro_batches,
        aux_values=aux_values,
        loss_scale=scaler.scale if scaler is not None else None,
        loss_reduction=loss_reduction,
    )
    params = list(model.parameters())
    if scaler is not None:
        scaler.unscale_(params)
    norm = engine.clip_grad_norm_(params, max_grad_norm) if max_grad_norm else engine.grad_norm(params)
    engine.reduce_step_loss(loss)
    apply = scaler is None or scaler.update(norm, step)
    seen_norm = norm if apply else torch.zeros((), device=norm.device)
    if (guard is None or guard.step_is_finite(step, loss, seen_norm)) and apply:
        optimizer.step()
    if scheduler is not None:
        scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    if engine.options.float8.enabled:
        precompute_scales(model, engine.options.float8)
    aux = torch.stack(aux_values).sum() if aux_values else None
    return StepResult(loss, norm, aux)


@contextlib.contextmanager
def evaluation(model: torch.nn.Module):
    """``model.eval()`` and no gradients inside the block; training mode after it."""
    model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        model.train()
