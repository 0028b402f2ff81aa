"""Preemption: SIGTERM or SIGUSR1 — what SLURM (``--signal=USR1@120``, ``scancel``, preemption),
Kubernetes and the elastic agent send before a job is killed — stops the job cleanly.

``PreemptionWatch`` records the signal in a handler that only sets a flag. The ranks agree once per
optimizer step (``should_stop``) with one 8-byte all-reduce (MIN of "seconds left until this rank's
deadline") on a gloo group, started asynchronously after step k and read after step k+1: gloo runs
it on its own threads while step k+1 computes, so the agreement adds no device sync and, in
practice, no wait (one step of latency instead). Every rank reads the same reduced value, so all
decide to stop after the same step: no rank waits forever for a peer that decided otherwise.

The caller then checkpoints and exits with ``PREEMPTED_EXIT``. A watchdog thread ends the process
with that code at the deadline (``timeout_s`` after the first signal on any rank) whatever it is
doing — a save cut short there leaves no ``COMPLETE`` marker, so the previous complete checkpoint
stays the resume point. Further signals while stopping change nothing (one line says so).
SIGINT (Ctrl-C) is not a preemption: it raises ``KeyboardInterrupt`` at once, as by default, and
``interrupted`` tells the caller that a later error was its consequence.
"""

from __future__ import annotations

import math
import os
import signal
import sys
import threading
import time

PREEMPTED_EXIT = 75
"""Exit code of a preempted job (``EX_TEMPFAIL``, "try again later"): a requeue wrapper restarts
the same command, which resumes from the newest complete checkpoint."""
INTERRUPTED_EXIT = 130
"""Exit code after Ctrl-C / SIGINT (128 + SIGINT, the shell's convention)."""
PREEMPTION_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
DEFAULT_TIMEOUT_S = 100.0
"""Seconds from the first signal until the job exits even without a checkpoint; fits SLURM's
``--signal=USR1@120`` with room to exit. Set it below the scheduler's grace period."""


class Preempted(Exception):
    """Raised on every rank once the job stopped for a preemption signal (after the checkpoint)."""

    def __init__(self, message: str, step: int, checkpoint=None):
        super().__init__(message)
        self.step = step
        self.checkpoint = checkpoint


class PreemptionWatch:
    """Turns SIGTERM/SIGUSR1 on any rank into one agreed stop on every rank.

    Use as a context manager around the training loop (main thread) and call ``should_stop()``
    once after every optimizer step on every rank; when it returns True, save, call
    ``finished()`` and exit with ``PREEMPTED_EXIT`` (``exit()`` does both). ``group``: a process
    group with a CPU (gloo) backend (default: the default group when it has one, else a new gloo
    group — collective, every rank must construct the watch at the same point).
    ``on_deadline(message)`` runs in the watchdog thread just before it ends the process. This
    module imports torch only when it needs it (its exit codes are read by a launcher that may be
    interrupted while importing torch).
    """

    def __init__(
        self,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        *,
        group=None,
        signals=PREEMPTION_SIGNALS,
        name: str = "ndparallel",
        on_deadline=None,
    ):
        if not timeout_s > 0:
            raise ValueError(f"preemption timeout must be > 0 seconds, got {timeout_s}")
        self.timeout_s = float(timeout_s)
        self.signals = tuple(signals)
        self.name = name
        self.on_deadline = on_deadline
        self.signal_name: str | None = None  # the first signal seen here (or agreed on)
        self.interrupted = False  # SIGINT seen: later errors are its consequences
        self.stopping = False  # the ranks agreed to stop
        self.step: int | None = None  # the step at which they agreed (set by the caller)
        self._deadline: float | None = None  # monotonic
        self._pending = None  # (work, tensor, started) of the last asynchronous all-reduce
        self._previous: dict = {}
        self._watchdog: threading.Thread | None = None
        self._done = threading.Event()
        self._group = group if group is not None else _cpu_group()

    # ------------------------------------------------------------------- handlers
    def __enter__(self) -> PreemptionWatch:
        self.install()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def install(self) -> None:
        """Handle the preemption signals (and SIGINT) here; main thread only."""
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("PreemptionWatch must be installed from the main thread (signal handlers)")
        for sig in (*self.signals, signal.SIGINT):
            self._previous[sig] = signal.signal(sig, self._on_signal)

    def close(self) -> None:
        """Restore the previous handlers; let the last agreement collective finish."""
        self.settle()
        for sig, handler in self._previous.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
        self._previous.clear()
        self._done.set()

    def _on_signal(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if signum == signal.SIGINT:
            self.interrupted = True
            raise KeyboardInterrupt
        if self.signal_name is not None:  # (SLURM signals the launcher and the ranks: expected)
            if os.environ.get("RANK", "0") == "0":  # os.write: print may be mid-write in the main thread
                _say(
                    f"{self.name}: {name} received while stopping for {self.signal_name}: ignored "
                    "(the checkpoint in progress completes, or is left without a COMPLETE marker)"
                )
            return
        self.signal_name = name
        self._start_deadline(time.monotonic() + self.timeout_s)

    @property
    def requested(self) -> bool:
        """A preemption signal reached this process."""
        return self.signal_name is not None

    def request(self, signal_name: str = "request") -> None:
        """Ask for a stop from code (as a signal would)."""
        if self.signal_name is None:
            self.signal_name = signal_name
            self._start_deadline(time.monotonic() + self.timeout_s)

    # ------------------------------------------------------------------ agreement
    def should_stop(self) -> bool:
        """Collective (call on every rank, once per optimizer step): True on every rank after the
        same step once any rank got a signal — the step after the one during which it arrived."""
        if self.stopping:
            return True
        if self._group is None:  # one process
            self.stopping = self.requested
            return self.stopping
        import torch
        import torch.distributed as dist

        left = math.inf
        if self._pending is not None:
            work, tensor, started = self._pending
            work.wait()
            self._pending = None
            left = float(tensor[0])
            if left < math.inf:
                self.stopping = True
                self.signal_name = self.signal_name or "a signal to another rank"
                self._start_deadline(started + left)
                return True
        tensor = torch.tensor([self._left()], dtype=torch.float64)
        self._pending = (
            dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=self._group, async_op=True),
            tensor,
            time.monotonic(),
        )
        return False

    def _left(self) -> float:
        return math.inf if self._deadline is None else max(0.0, self._deadline - time.monotonic())

    def settle(self) -> None:
        """Wait for the agreement collective in flight (before leaving the process group; the
        signal handlers stay)."""
        if self._pending is not None:
            work, _, _ = self._pending
            self._pending = None
            work.wait()

    # ------------------------------------------------------------------- deadline
    def seconds_left(self) -> float:
        """Until the deadline (inf before any signal)."""
        return self._left()

    def _start_deadline(self, deadline: float) -> None:
        if self._deadline is not None and self._deadline <= deadline:
            return
        self._deadline = deadline
        if self._watchdog is None:
            self._watchdog = threading.Thread(
                target=self._expire, name="ndparallel-preemption-deadline", daemon=True
            )
            self._watchdog.start()

    def _expire(self) -> None:
        while not self._done.is_set():
            left = self._left()
            if left <= 0:
                break
            self._done.wait(min(left, 1.0))
        if self._done.is_set():
            return
        where = f" at step {self.step}" if self.step is not None else ""
        message = (
            f"{self.name}: preempted ({self.signal_name}){where}: no checkpoint within "
            f"preemption_timeout_s={self.timeout_s:g}: exiting without one "
            f"(exit {PREEMPTED_EXIT}); the newest complete checkpoint stays the resume point"
        )
        if self.on_deadline is not None:
            try:
                self.on_deadline(message)
            except Exception:  # noqa: BLE001 - the exit below must happen
                pass
        if os.environ.get("RANK", "0") == "0":
            _say(message)
        os._exit(PREEMPTED_EXIT)

    def finished(self) -> None:
        """The stop is complete (checkpoint written): the deadline no longer applies."""
        self._done.set()

    def die_of_signal(self) -> None:
        """End this process by the preemption signal it received, as it would have ended without
        this watch: for an error that follows a signal before the ranks could agree (the launcher
        stopping this rank because a peer failed), where a traceback would only add noise."""
        if self.signal_name in {s.name for s in self.signals}:
            sig = signal.Signals[self.signal_name]
            signal.signal(sig, signal.SIG_DFL)
            os.kill(os.getpid(), sig)
            time.sleep(5)  # delivered at once; never reached

    def exit(self, message: str | None = None) -> None:
        """End this process with ``PREEMPTED_EXIT`` after the agreed stop (and checkpoint); rank 0
        prints ``message`` (default: which signal, after which step)."""
        self.finished()
        if os.environ.get("RANK", "0") == "0":
            where = f" after step {self.step}" if self.step is not None else ""
            _say(message or f"{self.name}: preempted ({self.signal_name}){where}: exit {PREEMPTED_EXIT}")
        raise SystemExit(PREEMPTED_EXIT)


def _cpu_group():
    """A group that can all-reduce a CPU tensor: the default one when it has a gloo backend (the
    engine's ``cpu:gloo,cuda:nccl``), else a new gloo group. None for one process."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return None
    if "gloo" in str(dist.get_backend()):
        return dist.group.WORLD
    return dist.new_group(backend="gloo")


def _say(line: str) -> None:
    try:
        os.write(sys.stderr.fileno(), (line + "\n").encode())
    except (OSError, ValueError):
        pass
