"""One optimizer step's forward and backward over its micro-batches, shared by ``ndparallel train``,
the equivalence checks and ``ndparallel verify`` so all three exercise the very same code.

The step never waits for the device: the token count stays a device tensor, the loss is summed on
the device, nothing is read back (``tests/test_host_sync.py`` counts the reads)."""

from __future__ import annotations

import contextlib
from typing import Mapping, Sequence

import torch


def batch_to_device(batch: Mapping[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """Copy a host batch to ``device``: through pinned memory and without blocking the host on
    CUDA (the copy is queued before the step's kernels that read it); as is on CPU."""
    if device.type != "cuda":
        return {k: v.to(device) for k, v in batch.items()}
    return {k: v.pin_memory().to(device, non_blocking=True) for k, v in batch.items()}


def forward_backward(
    acc, model: torch.nn.Module, micro_batches: Sequence[Mapping[str, torch.Tensor]],
    skip_grad_sync: bool = False,
) -> torch.Tensor:
    """Run every micro-batch (CP-sharded when CP is on) with the layout-invariant loss and
    back-propagate it. Returns this rank's share of the step loss (a device tensor): summed over
    the ``dp_cp`` ranks it is the global mean token loss. ``skip_grad_sync`` never reduces
    gradients: a deliberately broken run, used to prove that the equivalence checks can fail."""
    n_items = acc.global_num_items(micro_batches)
    loss_sum = torch.zeros((), device=acc.device)
    for mb in micro_batches:
        no_sync = acc.no_sync(model) if skip_grad_sync else contextlib.nullcontext()
        with acc.accumulate(model), no_sync, acc.maybe_context_parallel(
            buffers=[mb["input_ids"], mb["shift_labels"], mb["position_ids"]],
            buffer_seq_dims=[1, 1, 1],
        ):
            loss = acc.forward_loss(model, mb, n_items)
            acc.backward(loss, num_items_in_batch=n_items)
        loss_sum += loss.detach().float()
    return loss_sum
