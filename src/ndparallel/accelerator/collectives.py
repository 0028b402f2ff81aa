"""Accelerate's cross-process helpers (``gather``, ``reduce``, ``pad_across_processes``,
``broadcast``) on tensors or nested lists/tuples/dicts of tensors, over all processes, and the
Accelerator's ``gather_for_metrics`` (over the data-parallel ranks only: tp/cp peers hold the same
samples, so gathering over the world would count each sample tp·cp times)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist


def recursively_apply(fn: Callable, data: Any) -> Any:
    if isinstance(data, torch.Tensor):
        return fn(data)
    if isinstance(data, dict):
        return type(data)({k: recursively_apply(fn, v) for k, v in data.items()})
    if isinstance(data, (list, tuple)):
        return type(data)(recursively_apply(fn, v) for v in data)
    raise TypeError(f"expected a tensor or a nested list/tuple/dict of tensors, got {type(data).__name__}")


def _world(group) -> int:
    return dist.get_world_size(group) if dist.is_initialized() else 1


def gather(tensor: Any, group=None) -> Any:
    """Concatenate each tensor (dim 0; scalars become length-1) from every process of ``group``
    (default: all), in rank order. Shapes must agree (see ``pad_across_processes``)."""

    def one(t: torch.Tensor) -> torch.Tensor:
        t = t.detach().contiguous()
        if t.ndim == 0:
            t = t[None]
        if _world(group) == 1:
            return t.clone()
        parts = [torch.empty_like(t) for _ in range(_world(group))]
        dist.all_gather(parts, t, group=group)
        return torch.cat(parts, dim=0)

    return recursively_apply(one, tensor)


def gather_object(obj: Any, group=None) -> list:
    """Every process's ``obj`` (picklable), flattened one level when they are lists."""
    out = [None] * _world(group)
    if _world(group) == 1:
        out = [obj]
    else:
        dist.all_gather_object(out, obj, group=group)
    return [x for part in out for x in part] if all(isinstance(p, (list, tuple)) for p in out) else out


def reduce(tensor: Any, reduction: str = "sum", scale: float = 1.0) -> Any:
    """Sum, mean or max of each tensor over all processes (new tensors); ``"none"`` returns them."""
    if reduction not in ("sum", "mean", "max", "none"):
        raise ValueError(f"reduction must be 'sum', 'mean', 'max' or 'none', got {reduction!r}")
    if scale != 1.0:
        raise ValueError(f"scale={scale} is XLA-only in Accelerate: multiply the result instead")

    def one(t: torch.Tensor) -> torch.Tensor:
        out = t.detach().clone()
        if reduction == "none" or _world(None) == 1:
            return out
        dist.all_reduce(out, op=dist.ReduceOp.MAX if reduction == "max" else dist.ReduceOp.SUM)
        return out / _world(None) if reduction == "mean" else out

    return recursively_apply(one, tensor)


def pad_across_processes(tensor: Any, dim: int = 0, pad_index: int = 0, pad_first: bool = False) -> Any:
    """Pad each tensor along ``dim`` to the largest size any process has (for ``gather``)."""

    def one(t: torch.Tensor) -> torch.Tensor:
        if t.ndim == 0 or dim >= t.ndim or _world(None) == 1:
            return t
        size = torch.tensor([t.shape[dim]], device=t.device)
        sizes = gather(size)
        longest = int(sizes.max())
        if longest == t.shape[dim]:
            return t
        shape = list(t.shape)
        shape[dim] = longest
        out = t.new_full(shape, pad_index)
        index = slice(longest - t.shape[dim], longest) if pad_first else slice(0, t.shape[dim])
        out[(slice(None),) * dim + (index,)] = t
        return out

    return recursively_apply(one, tensor)


def broadcast(tensor: Any, from_process: int = 0) -> Any:
    """Every process gets ``from_process``'s tensors (in place, returned)."""

    def one(t: torch.Tensor) -> torch.Tensor:
        if _world(None) > 1:
            dist.broadcast(t, src=from_process)
        return t

    return recursively_apply(one, tensor)


def broadcast_object_list(objects: list, from_process: int = 0) -> list:
    if _world(None) > 1:
        dist.broadcast_object_list(objects, src=from_process)
    return objects


def reorder_last_batch(data: torch.Tensor, dp: int, remainder: int) -> torch.Tensor:
    """The last global batch, gathered rank by rank from an interleaving ``DistributedSampler``
    (rank r holds samples r, r+dp, ...), put back in sampler order with the padding cut off."""
    if data.shape[0] % dp:
        return data[:remainder]
    per = data.shape[0] // dp
    ordered = data.reshape(dp, per, *data.shape[1:]).transpose(0, 1).reshape(data.shape)
    return ordered[:remainder]


class CollectivesMixin:
    def gather(self, tensor: Any) -> Any:
        """Accelerate's ``gather``: over all processes, concatenated on dim 0."""
        return gather(tensor)

    def reduce(self, tensor: Any, reduction: str = "sum", scale: float = 1.0) -> Any:
        """Accelerate's ``reduce``: default ``"sum"`` over all processes (``"mean"``, ``"max"``)."""
        return reduce(tensor, reduction, scale)

    def pad_across_processes(self, tensor: Any, dim: int = 0, pad_index: int = 0, pad_first: bool = False):
        return pad_across_processes(tensor, dim=dim, pad_index=pad_index, pad_first=pad_first)

    def gather_for_metrics(self, input_data: Any, use_gather_object: bool = False) -> Any:
        """Gather ``input_data`` over the data-parallel ranks (each sample once), dp-rank order;
        at the end of a prepared loader the padding the sampler added is dropped."""
        group = self.mesh("dp").get_group()
        try:
            recursively_apply(lambda t: t, input_data)
            tensors = not use_gather_object
        except TypeError:
            tensors = False
        data = gather(input_data, group) if tensors else gather_object(input_data, group)
        state = self.gradient_state
        if not (state.end_of_dataloader and state.remainder > 0):
            return data
        if not tensors:
            return data[: state.remainder]
        return recursively_apply(lambda t: reorder_last_batch(t, self.dp_size, state.remainder), data)
