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

Host memory that stands for a GPU's pinned host memory (the activation offloader's copies, made
inside ``host_allocations()``) is counted apart, in ``host_cur`` / ``host_peak``: on a CPU device
it is a CPU tensor like any other, on a GPU it is not in the device's allocator.

``LiveBytes(trace=True)`` also keeps a log of every allocation and free with where it came from
(the op, the autograd node running it, the innermost frame outside torch);
``at_peak()`` replays the log to the peak and returns the live bytes grouped by that origin —
what holds the peak.
"""

from __future__ import annotations

import collections
import contextlib
import resource
import sys
import sysconfig
import weakref
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.weak import WeakIdKeyDictionary

_host_depth = 0
_HOST = ("host",)  # the origin recorded for a host copy (its size is not in the device's count)


@contextlib.contextmanager
def host_allocations():
    """Tensors made inside are host memory on a GPU (pinned copies): ``LiveBytes`` counts them
    apart from the device's bytes."""
    global _host_depth
    _host_depth += 1
    try:
        yield
    finally:
        _host_depth -= 1


class LiveBytes(TorchDispatchMode):
    """Bytes of tensor storage created inside the block and still alive; ``peak`` its maximum."""

    def __init__(self, trace: bool = False):
        super().__init__()
        self.cur = self.peak = 0
        self.host_cur = self.host_peak = 0
        self._sizes = WeakIdKeyDictionary()
        self._refs: set = set()
        self._orig_resize = None
        self.trace = trace
        self._log: list = []  # (bytes, origin): + at an allocation or growth, - at a free
        self._peak_at = 0

    def _add(self, n: int, origin) -> None:
        self.cur += n
        if self.trace:
            self._log.append((n, origin))
        if self.cur > self.peak:
            self.peak, self._peak_at = self.cur, len(self._log)

    def _free(self, rec, ref):
        self._add(-rec[0], rec[1])
        self._refs.discard(ref)

    def _free_host(self, n: int, ref) -> None:
        self.host_cur -= n
        self._refs.discard(ref)

    def _track(self, st, n=None, op: str = "resize_"):
        if st in self._sizes:
            return
        if _host_depth:  # a pinned host copy on a GPU: not device memory
            n = st.nbytes() if n is None else n
            self._sizes[st] = [0, _HOST]
            self._refs.add(weakref.ref(st, lambda r, n=n: self._free_host(n, r)))
            self.host_cur += n
            self.host_peak = max(self.host_peak, self.host_cur)
            return
        rec = [0, _origin(op) if self.trace else None]
        self._sizes[st] = rec
        self._refs.add(weakref.ref(st, lambda r, rec=rec: self._free(rec, r)))
        rec[0] = st.nbytes() if n is None else n
        self._add(rec[0], rec[1])

    def at_peak(self) -> list[tuple[tuple, int]]:
        """(origin, bytes alive at the peak) from the largest, for allocations made inside the
        block (``trace=True`` only); origin = (op, autograd node or '', innermost frame)."""
        live: collections.Counter = collections.Counter()
        for n, origin in self._log[: self._peak_at]:
            live[origin] += n
        return [(o, n) for o, n in live.most_common() if n]

    def __enter__(self):
        orig = self._orig_resize = torch.UntypedStorage.resize_
        mode = self

        def resize_(st, size):
            out = orig(st, size)
            if st in mode._sizes:
                rec = mode._sizes[st]
                if rec[1] is _HOST:
                    return out
                grown, rec[0] = size - rec[0], size
                mode._add(grown, rec[1])
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
                    self._track(t.untyped_storage(), op=func.__name__)
                except (RuntimeError, NotImplementedError):
                    pass
        return out


_LIBRARY_DIRS = (str(Path(torch.__file__).parent), sysconfig.get_paths()["stdlib"])


def _library_frame(name: str) -> bool:
    """torch's, the standard library's (not site-packages') or this module's code."""
    if name == __file__ or name.startswith(_LIBRARY_DIRS[0]):
        return True
    return name.startswith(_LIBRARY_DIRS[1]) and "site-packages" not in name


def _origin(op: str) -> tuple:
    """(op, the autograd node executing it or '', the innermost frame outside torch, the standard
    library and this module, as 'file:line function')."""
    node = torch._C._current_autograd_node()
    f = sys._getframe(2)
    while f is not None and _library_frame(f.f_code.co_filename):
        f = f.f_back
    where = "" if f is None else f"{Path(f.f_code.co_filename).name}:{f.f_lineno} {f.f_code.co_name}"
    return op, "" if node is None else node.name(), where


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
