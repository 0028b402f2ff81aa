"""Global gradient norm and clipping for parameters on any mix of meshes and plain tensors, in one
collective.

``torch.nn.utils.clip_grad_norm_`` stacks per-parameter norms and fails when DTensors live on
different meshes (e.g. norms on ``dp_shard`` and linears on ``(dp_shard, tp)``), and a norm's
``full_tensor()`` over a 2-D mesh is one all-reduce per mesh dimension (torch warns: more latency,
and ranks that may disagree on the result). Here each rank sums ``|g|^p`` of its local shards,
counting every distinct piece of every gradient once across the world, and one all-reduce (SUM,
or MAX for the inf-norm) over all ranks adds the pieces up: the same bytes on every rank.

Which rank counts a piece: a gradient replicated along a dimension of its mesh is counted by the
rank at coordinate 0 of that dimension (one still Partial there is summed first, as torch's norm of
it would); copies of a whole mesh elsewhere in the world (a mesh that
spans fewer ranks than its stage, a plain tensor on every rank) are weighted 1/copies. Every rank of
a pipeline stage holds a piece of each of the stage's parameters (the stages hold different ones).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate


def _group_key(t: torch.Tensor):
    if isinstance(t, DTensor):
        return ("dtensor", id(t.device_mesh), t.device_mesh.device_type)
    return ("tensor", t.device.type)


def grouped_grads(parameters: Iterable[torch.Tensor]) -> dict[tuple, list[torch.Tensor]]:
    groups: dict[tuple, list[torch.Tensor]] = defaultdict(list)
    for p in parameters:
        if p.grad is not None:
            groups[_group_key(p.grad)].append(p.grad)
    return groups


def _share(grad: torch.Tensor, holders: int) -> float:
    """The weight of this rank's local piece of ``grad`` (no Partial placement) in the global sum
    of ``|g|^p``: 0 where another rank counts the same piece, 1 / (copies of its mesh among the
    ``holders`` ranks) else."""
    if not isinstance(grad, DTensor):
        return 1.0 / holders
    mesh = grad.device_mesh
    coordinate = mesh.get_coordinate()
    for dim, placement in enumerate(grad.placements):
        if placement.is_replicate() and coordinate[dim] != 0:
            return 0.0
    return 1.0 / max(1, holders // mesh.size())


def _summed(grad: torch.Tensor) -> torch.Tensor:
    """``grad`` with its Partial mesh dims reduced (a copy, for the norm: the optimizer step reduces
    the gradient itself): a replicated weight fed sharded activations without FSDP, e.g. a norm
    weight under sequence parallel on a TP-only mesh, gets a Partial gradient from DTensor."""
    if not isinstance(grad, DTensor) or not any(p.is_partial() for p in grad.placements):
        return grad
    return grad.redistribute(
        grad.device_mesh, [Replicate() if p.is_partial() else p for p in grad.placements]
    )


def _local_power_sum(grads: list[torch.Tensor], norm_type: float, holders: int, device) -> torch.Tensor:
    """Sum over ``grads`` of share · ``|local shard|_p^p`` (inf: the max of the local maxima), fp32."""
    inf = norm_type == float("inf")
    by_share: dict[tuple, list[torch.Tensor]] = defaultdict(list)
    for g in map(_summed, grads):
        share = 1.0 if inf else _share(g, holders)
        local = g.to_local() if isinstance(g, DTensor) else g
        if share and local.numel():  # an empty shard (more ranks than rows) adds nothing
            by_share[(share, local.device)].append(local)
    total = torch.zeros((), dtype=torch.float32, device=device)
    for (share, _), tensors in by_share.items():
        n = torch.nn.utils.get_total_norm(tensors, norm_type=norm_type, foreach=None).float().to(device)
        total = torch.maximum(total, n) if inf else total + share * n.pow(norm_type)
    return total


def total_grad_norm(
    parameters: Iterable[torch.Tensor],
    norm_type: float = 2.0,
    stages: int = 1,
    device: torch.device | None = None,
) -> torch.Tensor:
    """The true global gradient norm: a plain fp32 scalar on ``device`` (default: the first
    gradient's), the same on every rank: one all-reduce over the world when a process group is
    up. Never read on the host (no sync). ``stages``: pipeline stages, each held by world / stages
    ranks and holding different parameters (tied copies left out by the caller)."""
    norm_type = float(norm_type)
    grads = [p.grad for p in parameters if p.grad is not None]
    if device is None:
        device = grads[0].device if grads else torch.device("cpu")
    distributed = dist.is_available() and dist.is_initialized()
    holders = dist.get_world_size() // stages if distributed else 1
    total = _local_power_sum(grads, norm_type, holders, device)
    inf = norm_type == float("inf")
    if distributed and dist.get_world_size() > 1:
        dist.all_reduce(total, op=dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM)
    return total if inf else total.pow(1.0 / norm_type)


def clip_grad_norm_(
    parameters: Iterable[torch.Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    stages: int = 1,
    device: torch.device | None = None,
) -> torch.Tensor:
    """Scale gradients so their global norm is at most ``max_norm``; return the norm before.
    The scale is computed and applied on the device, as torch's own clipping does (no sync).
    ``stages``: see ``total_grad_norm``."""
    parameters = list(parameters)
    total = total_grad_norm(parameters, norm_type, stages, device)
    scale_grads_to(parameters, total, max_norm)
    return total


def scale_grads_to(parameters: Iterable[torch.Tensor], total: torch.Tensor, max_norm: float) -> None:
    """Scale the gradients of ``parameters`` by min(1, max_norm / ``total``) (on the device)."""
    coef = (float(max_norm) / (total + 1e-6)).clamp(max=1.0)
    for grads in grouped_grads(parameters).values():
        torch._foreach_mul_(grads, coef.to(grads[0].device))
