"""Count the bytes a forward saves for backward, per storage, with torch's saved-tensor hooks.

``SavedBytes`` is an observing pack hook (``parallel/tp/sp_saves.observing``): it returns every tensor
unchanged and records the storage it lives in, so tensors sharing one storage (views, a weight
saved by several ops) count once; a DTensor counts its local tensor, i.e. what this rank holds.
Parameters and buffers are not activations: pass them in ``exclude`` to leave them out.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch.distributed.tensor import DTensor

from ndparallel.parallel.tp.sp_saves import observing


class SavedBytes:
    """Context manager: bytes of the distinct storages saved for backward inside it (``.total``)."""

    def __init__(self, exclude: Iterable[torch.Tensor] = ()):
        self._excluded = {_local(t).untyped_storage().data_ptr() for t in exclude}
        self.storages: dict[int, int] = {}
        self._hooks = torch.autograd.graph.saved_tensors_hooks(
            observing(lambda t: self._pack(t)), lambda t: t
        )

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        local = _local(t)
        if local.device.type != "meta":
            ptr = local.untyped_storage().data_ptr()
            if ptr not in self._excluded:
                self.storages[ptr] = local.untyped_storage().nbytes()
        return t

    @property
    def total(self) -> int:
        return sum(self.storages.values())

    def __enter__(self) -> SavedBytes:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t
