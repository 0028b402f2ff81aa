"""Memory of one rank's training step, measured: peak RSS (what ``train`` logs on CPU), the CUDA
allocator's peak, and on CPU the bytes of tensor storage alive — the quantity the planner's memory
model predicts (``MemoryBreakdown.allocated``).

torch keeps no statistics for its CPU allocator, so ``LiveBytes`` counts storages itself: every
op output's storage (a ``TorchDispatchMode``), freed by a weakref callback, and
``UntypedStorage.resize_`` followed (FSDP2 frees and re-allocates unsharded parameters that
way; the method is wrapped only inside the block and restored on exit — no extension point
reports it). Outputs the op schema declares as aliases of an input and wrapper-subclass outputs
own no new memory and are skipped. Allocator caching/fragmentation and the Python/torch runtime
are not counted.
"""

from __future__ import annotations

import resource
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.weak import WeakIdKeyDictionary


class LiveBytes(TorchDispatchMode):
    """Bytes of tensor storage created inside the block and still alive; ``peak`` its maximum."""

    def __init__(self):
        super().__init__()
        self.cur = self.peak = 0
        self._sizes = WeakIdKeyDictionary()
        self._refs: set = set()
        self._orig_resize = None

    def _free(self, rec, ref):
        self.cur -= rec[0]
        self._refs.discard(ref)

    def _track(self, st, n=None):
        if st in self._sizes:
            return
        rec = [st.nbytes() if n is None else n]
        self._sizes[st] = rec
        self._refs.add(weakref.ref(st, lambda r, rec=rec: self._free(rec, r)))
        self.cur += rec[0]
        self.peak = max(self.peak, self.cur)

    def __enter__(self):
        orig = self._orig_resize = torch.UntypedStorage.resize_
        mode = self

        def resize_(st, size):
            out = orig(st, size)
            if st in mode._sizes:
                rec = mode._sizes[st]
                mode.cur += size - rec[0]
                rec[0] = size
                mode.peak = max(mode.peak, mode.cur)
            else:
                mode._track(st, size)
            return out

        torch.UntypedStorage.resize_ = resize_
        return super().__enter__()

    def __exit__(self, *exc):
        torch.UntypedStorage.resize_ = self._orig_resize
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.distributed.tensor import DTensor

        if any(issubclass(t, DTensor) for t in types):  # DTensor re-dispatches its local ops
            return NotImplemented
        out = func(*args, **(kwargs or {}))
        for t in fresh_outputs(func, out):
            # Plain tensors only: a wrapper subclass (funcol's AsyncCollectiveTensor) has a storage
            # without memory; its inner tensor was created, and is tracked, by its own op.
            if type(t) is torch.Tensor and t.device.type != "meta":
                try:
                    self._track(t.untyped_storage())
                except (RuntimeError, NotImplementedError):
                    pass
        return out


def fresh_outputs(func, out) -> list:
    """The outputs of ``func`` that its schema does not declare as aliases of an input.

    Views and in-place results (``t()`` of a weight, ``add_`` into a kept gradient) share an
    input's storage: it is either tracked already or existed before the window (parameters,
    gradients, the batch), where it is counted in the states or not at all.
    """
    outs = list(out) if isinstance(out, (list, tuple)) else [out]
    rets = func._schema.returns
    if len(rets) == 1:  # one return, possibly a Tensor[] list
        fresh = [rets[0].alias_info is None] * len(outs)
    else:
        fresh = [r.alias_info is None for r in rets]
    return [t for t, f in zip(outs, fresh) if f]


def local_tensor(t):
    return t.to_local() if hasattr(t, "to_local") else t


def state_bytes(model, opt) -> dict:
    """Bytes of this rank's parameter shards, gradients and optimizer states (unique storages,
    FSDP padding included): what exists before a step's forward."""
    seen = set()

    def nb(t):
        st = local_tensor(t).untyped_storage()
        if st.data_ptr() in seen:
            return 0
        seen.add(st.data_ptr())
        return st.nbytes()

    params = sum(nb(p) for p in model.parameters())
    grads = sum(nb(p.grad) for p in model.parameters() if p.grad is not None)
    optim = sum(
        nb(v) for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor) and v.numel() > 1
    )
    return {"params": params, "grads": grads, "optimizer": optim}


def peak_rss_bytes() -> int:
    """This process's peak resident set size since it started or since ``reset_peak_rss``
    (Linux's ``VmHWM``; elsewhere ``getrusage``'s lifetime peak)."""
    try:
        for line in open("/proc/self/status"):
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def reset_peak_rss() -> None:
    """Start the peak RSS over from the current RSS (Linux: ``/proc/self/clear_refs``); a no-op
    where that is unavailable."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass
