"""Global gradient norm and clipping for parameters on any mix of meshes and plain tensors.

``torch.nn.utils.clip_grad_norm_`` stacks per-parameter norms and fails when DTensors live on
different meshes (e.g. norms on ``dp_shard`` and linears on ``(dp_shard, tp)``). Here norms are
computed per (mesh, placement-kind) group with torch's own ``get_total_norm``, each group's DTensor
result is reduced to a plain tensor (``full_tensor``), and the groups are combined.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

import torch
from torch.distributed.tensor import DTensor


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


def total_grad_norm(
    parameters: Iterable[torch.Tensor],
    norm_type: float = 2.0,
    across=None,
    device: torch.device | None = None,
) -> torch.Tensor:
    """The true global gradient norm: a plain fp32 scalar on the gradients' device, the same on
    every rank. Never read on the host (no sync). ``across``: a process group whose ranks hold
    *different* parameters (pipeline stages): their norms are combined over it."""
    norm_type = float(norm_type)
    norms = []
    for grads in grouped_grads(parameters).values():
        n = torch.nn.utils.get_total_norm(grads, norm_type=norm_type, foreach=None)
        if isinstance(n, DTensor):
            n = n.full_tensor()
        norms.append(n.float())
    inf = norm_type == float("inf")
    if not norms:
        total = torch.zeros((), device=device)
    else:
        stacked = torch.stack([n.to(norms[0].device) for n in norms])
        total = stacked.max() if inf else stacked.pow(norm_type).sum()
    if across is not None:
        import torch.distributed as dist

        dist.all_reduce(total, op=dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM, group=across)
    return total if inf else total.pow(1.0 / norm_type)


def clip_grad_norm_(
    parameters: Iterable[torch.Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    across=None,
    device: torch.device | None = None,
) -> torch.Tensor:
    """Scale gradients so their global norm is at most ``max_norm``; return the norm before.
    The scale is computed and applied on the device, as torch's own clipping does (no sync).
    ``across``: see ``total_grad_norm``."""
    parameters = list(parameters)
    total = total_grad_norm(parameters, norm_type, across, device)
    scale_grads_to(parameters, total, max_norm)
    return total


def scale_grads_to(parameters: Iterable[torch.Tensor], total: torch.Tensor, max_norm: float) -> None:
    """Scale the gradients of ``parameters`` by min(1, max_norm / ``total``) (on the device)."""
    coef = (float(max_norm) / (total + 1e-6)).clamp(max=1.0)
    for grads in grouped_grads(parameters).values():
        torch._foreach_mul_(grads, coef.to(grads[0].device))
