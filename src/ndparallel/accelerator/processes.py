"""Which process is which, and running code on some of them: Accelerate's process properties (the
engine's answers under Accelerate's names), ``main_process_first``, the ``on_*`` decorators,
``split_between_processes`` and the breakpoint trigger. Mixed into ``Accelerator`` (it provides
``engine`` and ``device``)."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from ndparallel.runtime.preemption import DEFAULT_TIMEOUT_S, PreemptionWatch


class ProcessesMixin:
    engine: Any

    process_index = property(lambda self: self.engine.rank)
    num_processes = property(lambda self: self.engine.world_size)
    local_process_index = property(lambda self: self.engine.local_rank)
    is_main_process = property(lambda self: self.engine.is_main_process)
    is_local_main_process = property(lambda self: self.engine.is_local_main_process)
    is_last_process = property(lambda self: self.engine.rank == self.engine.world_size - 1)
    use_distributed = property(lambda self: self.engine.world_size > 1)

    @property
    def multi_device(self) -> bool:
        """Several GPU processes (Accelerate's MULTI_GPU family)."""
        return self.use_distributed and self.engine.device.type != "cpu"

    def wait_for_everyone(self) -> None:
        """Barrier over all processes."""
        self.engine.barrier()

    def print(self, *args, **kwargs) -> None:
        """``print`` on the local main process only (Accelerate's rule)."""
        self.engine.print(*args, **kwargs)

    # ------------------------------------------------------------- ordering
    @contextlib.contextmanager
    def main_process_first(self):
        """The main process runs the block first; the others enter once it has left it."""
        yield from self._first(self.is_main_process)

    @contextlib.contextmanager
    def local_main_process_first(self):
        """The local main process of each node runs the block first, then the others."""
        yield from self._first(self.is_local_main_process)

    def _first(self, is_first: bool):
        if not is_first:
            self.wait_for_everyone()
        yield
        if is_first:
            self.wait_for_everyone()

    # ------------------------------------------------------------ decorators
    def _on(self, function: Callable | None, run_here: Callable[[], bool]):
        def wrap(fn):
            @functools.wraps(fn)
            def runner(*args, **kwargs):
                return fn(*args, **kwargs) if run_here() else None

            return runner

        return wrap(function) if function is not None else wrap

    def on_main_process(self, function: Callable | None = None):
        """Decorator: run ``function`` on the main process only (others get None)."""
        return self._on(function, lambda: self.is_main_process)

    def on_local_main_process(self, function: Callable | None = None):
        return self._on(function, lambda: self.is_local_main_process)

    def on_last_process(self, function: Callable):
        return self._on(function, lambda: self.is_last_process)

    def on_process(self, function: Callable | None = None, process_index: int | None = None):
        if function is not None and process_index is None and isinstance(function, int):
            function, process_index = None, function
        return self._on(function, lambda: self.process_index == process_index)

    def on_local_process(self, function: Callable | None = None, local_process_index: int | None = None):
        return self._on(function, lambda: self.local_process_index == local_process_index)

    # ------------------------------------------------------------- splitting
    @contextlib.contextmanager
    def split_between_processes(self, inputs, apply_padding: bool = False):
        """This process's contiguous share of ``inputs`` (list, tuple, dict of equal-length values,
        or tensor; split over all processes, the first ones taking one more when it does not
        divide). ``apply_padding`` repeats the last element so every share has the same length."""
        yield _split(inputs, self.process_index, self.num_processes, apply_padding)

    # ---------------------------------------------------------- preemption
    def preemption(self, timeout_s: float | None = None):
        """(ndparallel) A ``PreemptionWatch``: ``with acc.preemption() as p:`` around the loop and
        ``if p.should_stop(): acc.save_state(...); p.exit()`` after every optimizer step, on every
        process. SIGTERM / SIGUSR1 to any rank or to the launcher then stops every rank after the
        same step; ``p.exit()`` ends the process with exit code 75 (preempted: requeue and resume).
        One 8-byte all-reduce per step on gloo, overlapped with the next step. ``timeout_s``
        (default 100): from the signal until the process exits even without a checkpoint."""

        return PreemptionWatch(DEFAULT_TIMEOUT_S if timeout_s is None else timeout_s)

    # ------------------------------------------------------------ triggers
    def set_trigger(self) -> None:
        """Raise this process's flag; ``check_trigger`` on every process then returns True."""
        self._flag_tensor = torch.tensor(1, device=self.device)

    def check_trigger(self) -> bool:
        """True (on every process) if any process called ``set_trigger``; resets the flag."""
        flag = getattr(self, "_flag_tensor", None)
        if flag is None:
            flag = torch.tensor(0, device=self.device)
        flag = flag.clone()
        if dist.is_initialized():
            dist.all_reduce(flag)
        if int(flag.item()) >= 1:
            self._flag_tensor = torch.tensor(0, device=self.device)
            return True
        return False


def _split(inputs, index: int, world: int, pad: bool):
    if isinstance(inputs, dict):
        lengths = {len(v) for v in inputs.values()}
        if len(lengths) > 1:
            raise ValueError("split_between_processes: all values of the dict must have the same length")
        return {k: _split(v, index, world, pad) for k, v in inputs.items()}
    n = len(inputs)
    per, extra = divmod(n, world)
    start = index * per + min(index, extra)
    end = start + per + (1 if index < extra else 0)
    part = inputs[start:end]
    if pad and n and end - start < per + (1 if extra else 0):
        missing = per + (1 if extra else 0) - (end - start)
        last = inputs[-1:] if not len(part) else part[-1:]
        if isinstance(inputs, torch.Tensor):
            part = torch.cat([part] + [last] * missing)
        else:
            part = part + type(inputs)(last) * missing
    return part
