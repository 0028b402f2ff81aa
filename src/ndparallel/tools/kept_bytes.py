"""Count the bytes a forward region leaves alive for backward, by the storages its ops created.

Saved-tensor hooks (``tools/saved_bytes.py``) see what autograd saves, but not what activation
checkpointing keeps by reference: ``torch.utils.checkpoint`` holds its region's inputs itself and
a selective policy caches the outputs it must save outside autograd. ``KeptBytes`` sees both: a
``TorchDispatchMode`` that, while entered, records a weak reference to the storage of every op
output (a DTensor's local tensor, i.e. what this rank holds); ``alive()`` — called after the whole
forward, before backward — sums the distinct storages still alive. Those are the region's
activations kept for backward (and its output if a later layer keeps it, as a checkpointed norm
of the next layer does); tensors made outside the region (RoPE's cos/sin, the embedding output)
are not counted. Parameters are not op outputs; pass any other storage to leave out in
``exclude``.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable

import torch
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class KeptBytes(TorchDispatchMode):
    """Context manager (may be entered several times): storages created inside it; ``alive()``."""

    def __init__(self):
        super().__init__()
        self._refs: list[tuple[weakref.ref, bool]] = []
        self.square_dim: int | None = None
        """When set (a sequence length): storages of tensors with two dims of this length are
        counted apart (attention scores, s²)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {_ptr(t) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                local = _local(t)
                ptr = _ptr(local)
                if ptr is not None and ptr not in inputs:  # new, not a view of an input
                    square = (
                        self.square_dim is not None and sum(n == self.square_dim for n in local.shape) >= 2
                    )
                    self._refs.append((weakref.ref(local.untyped_storage()), square))
        return out

    def alive(self, exclude: Iterable[torch.Tensor] = ()) -> tuple[int, int]:
        """(bytes of the distinct recorded storages still alive, of them the s² ones)."""
        skip = {_local(t).untyped_storage().data_ptr() for t in exclude}
        kept: dict[int, tuple[int, bool]] = {}
        for ref, square in self._refs:
            storage = ref()
            if storage is not None and storage.data_ptr() not in skip:
                nbytes, was = kept.get(storage.data_ptr(), (storage.nbytes(), False))
                kept[storage.data_ptr()] = (nbytes, was or square)
        return sum(n for n, _ in kept.values()), sum(n for n, s in kept.values() if s)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


def _ptr(t: torch.Tensor) -> int | None:
    """The storage's address; None for a meta tensor or a wrapper without storage of its own."""
    local = _local(t)
    if local.device.type == "meta":
        return None
    try:
        return local.untyped_storage().data_ptr()
    except RuntimeError:  # e.g. a functional collective's wrapper subclass
        return None
