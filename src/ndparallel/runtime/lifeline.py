"""A rank dies with its launcher: a ``kill -9`` of ``ndparallel launch`` / ``torchrun`` (or of the
whole node's agent) must not leave ranks training on, holding GPUs nobody watches.

Linux: ``prctl(PR_SET_PDEATHSIG, SIGKILL)`` — the kernel kills this process when its parent
exits. It is checked right after being set (a parent that died before has already handed us to
init or a sub-reaper) and backed by a thread that polls the parent's pid every second, for
systems without ``prctl``. The elastic agent starts each rank as its direct child, so the parent
is the launcher.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading

_PR_SET_PDEATHSIG = 1
LAUNCHER_PID_ENV = "NDPARALLEL_LAUNCHER_PID"  # set by ndparallel launch for its ranks
_THREAD = "ndparallel-lifeline"


def under_elastic_agent() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ


def die_with_launcher() -> bool:
    """Arrange for this process to be killed when its launcher (parent) goes away; returns
    whether a launcher was found. Safe to call more than once."""
    if not under_elastic_agent():
        return False
    if any(t.name == _THREAD for t in threading.enumerate()):
        return True
    parent = os.getppid()
    expected = os.environ.get(LAUNCHER_PID_ENV, "")
    if parent == 1 or (expected.isdigit() and int(expected) != parent and not _exists(int(expected))):
        _die("its launcher exited before this rank started")  # (a launcher nested in a rank: alive)
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        except (OSError, AttributeError):
            pass
        if os.getppid() != parent:  # it died between the two reads
            _die("its launcher exited")
    threading.Thread(target=_watch, args=(parent,), name=_THREAD, daemon=True).start()
    return True


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _watch(parent: int) -> None:
    stop = threading.Event()
    while not stop.wait(1.0):
        if os.getppid() != parent:
            _die("its launcher exited")


def _die(why: str) -> None:
    try:
        os.write(2, f"ndparallel: rank {os.environ.get('RANK', '?')} stops: {why}\n".encode())
    except OSError:
        pass
    os.kill(os.getpid(), signal.SIGKILL)
