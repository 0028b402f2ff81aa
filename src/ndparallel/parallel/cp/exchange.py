"""The collectives of the CP strategies: ring P2P hops and functional (autograd-free) all-gather /
reduce-scatter on dim 0 that work across torch versions (``all_gather_single`` and
``reduce_scatter_single`` exist from torch 2.12; 2.11 has ``all_gather_tensor`` /
``reduce_scatter_tensor``, deprecated later)."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol


def wait(t: torch.Tensor) -> torch.Tensor:
    """The value of a functional collective's result (waits for it)."""
    return t.wait() if isinstance(t, funcol.AsyncCollectiveTensor) else t


def all_gather(t: torch.Tensor, group) -> torch.Tensor:
    """Concatenation over dim 0 of ``t`` from every rank of ``group``, in rank order."""
    fn = getattr(funcol, "all_gather_single", None)
    return wait(fn(t, 0, group) if fn else funcol.all_gather_tensor(t, 0, group))


def reduce_scatter(t: torch.Tensor, group) -> torch.Tensor:
    """Sum over ranks of ``t``, this rank's slice of dim 0."""
    fn = getattr(funcol, "reduce_scatter_single", None)
    return wait(fn(t, "sum", 0, group) if fn else funcol.reduce_scatter_tensor(t, "sum", 0, group))


def ring_ops(pairs, group, tag: int) -> list:
    """P2P ops sending each ``send`` to rank+1 and receiving ``recv`` from rank-1 of ``group``."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    nxt = dist.get_global_rank(group, (rank + 1) % size)
    prv = dist.get_global_rank(group, (rank - 1) % size)
    ops = []
    for send, recv in pairs:
        ops.append(dist.P2POp(dist.isend, send, nxt, group, tag))
        ops.append(dist.P2POp(dist.irecv, recv, prv, group, tag))
    return ops


def start(ops) -> list:
    return dist.batch_isend_irecv(ops) if ops else []


def finish(reqs) -> None:
    for r in reqs:
        r.wait()
