"""Layout-invariant causal-LM loss.

The loss of one optimizer step is ``sum of token losses / number of non-ignored tokens of the whole
global batch`` (every dp×cp rank, every accumulation micro-batch). Each rank back-propagates its own
token-loss sum divided by that *global* count, and the strategies *sum* gradients over ranks, so the
gradient equals the one a single device computes on the whole global batch, whatever the layout.

``loss_reduction: micro_batch_mean`` (``micro_batch_num_items``) gives Axolotl's loss instead: each
dp rank's micro-batch averaged over its own trained tokens, the step's loss the mean of those means.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

IGNORE_INDEX = -100


def count_loss_tokens(shift_labels: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Number of non-ignored label positions (int64 tensor)."""
    return (shift_labels != ignore_index).sum()


def global_num_items(
    micro_batches: Iterable[Mapping[str, torch.Tensor]],
    dp_group: dist.ProcessGroup | None,
    label_key: str = "shift_labels",
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """Non-ignored label tokens over all ``micro_batches`` of this step and all dp ranks: an int64
    scalar tensor on ``device``, never read on the host (no sync; divide losses by it as is).

    Pass the micro-batches *before* context-parallel sharding (cp peers hold the same samples, so
    counting over the ``dp`` group, not ``dp_cp``, is exact)."""
    counts = [count_loss_tokens(mb[label_key]).to(device, non_blocking=True) for mb in micro_batches]
    total = torch.stack(counts).sum() if counts else torch.zeros((), dtype=torch.int64, device=device)
    if dp_group is not None and dist.get_world_size(dp_group) > 1:
        dist.all_reduce(total, group=dp_group)
    return total


def micro_batch_num_items(
    micro_batches: Sequence[Mapping[str, torch.Tensor]],
    dp_group: dist.ProcessGroup | None,
    label_key: str = "shift_labels",
    device: torch.device | str = "cpu",
) -> list[torch.Tensor]:
    """The divisor of each of this rank's ``micro_batches`` under Axolotl's normalisation: its own
    trained-token count × the number of micro-batches over all dp ranks that train any token. The
    strategies sum the ranks' gradients, so the step's loss is the mean of the micro-batches' token
    means (transformers' ``Trainer`` without ``num_items_in_batch``: each micro-batch's mean / the
    accumulation steps, averaged over the ranks). A micro-batch with no trained token adds nothing
    (Axolotl's is NaN). Counted before CP sharding; int64 device tensors, no host sync."""
    if not micro_batches:
        return []
    counts = torch.stack(
        [count_loss_tokens(mb[label_key]).to(device, non_blocking=True) for mb in micro_batches]
    )
    trained = (counts > 0).sum()
    if dp_group is not None and dist.get_world_size(dp_group) > 1:
        dist.all_reduce(trained, group=dp_group)
    return list(counts.clamp(min=1) * trained)


def causal_lm_loss(
    logits: torch.Tensor,
    shift_labels: torch.Tensor,
    num_items_in_batch: int | torch.Tensor,
    ignore_index: int = IGNORE_INDEX,
) -> torch.Tensor:
    """Sum of token cross-entropies over this rank's (already shifted) labels / ``num_items_in_batch``.

    Works on plain logits and on vocab-sharded DTensor logits inside ``loss_parallel()``; the
    result is a plain scalar tensor. Logits are upcast to fp32 for the softmax."""
    labels = shift_labels.reshape(-1)
    if isinstance(logits, DTensor):
        flat = logits.reshape(-1, logits.shape[-1])
        if flat.dtype != torch.float32:
            flat = flat.float()
        loss_sum = F.cross_entropy(flat, labels, ignore_index=ignore_index, reduction="sum")
        if isinstance(loss_sum, DTensor):
            loss_sum = loss_sum.full_tensor()
    else:
        flat = logits.reshape(-1, logits.shape[-1]).float()
        loss_sum = F.cross_entropy(flat, labels, ignore_index=ignore_index, reduction="sum")
    return loss_sum / num_items_in_batch
