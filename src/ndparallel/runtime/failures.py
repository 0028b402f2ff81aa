"""What the launcher says when its ranks failed: the first failure, and which ranks hung.

When a rank hangs (stopped, deadlocked, stuck outside any collective), its peers' collectives time
out: one of them is the *first failure* the elastic agent sees. The agent then sends SIGTERM to
the ranks still running and, 30 s later (torch's fixed grace on this path), SIGKILL to those that
did not exit.
A rank waiting in a collective exits on SIGTERM at once (or, with a preemption handler, when its
own collective times out); a rank that is stopped (SIGSTOP) or stuck does not — so the ranks
that had to be SIGKILLed are the ones that hung, not the ones SIGTERM stopped.
"""

from __future__ import annotations

import signal
import sys

from ndparallel.runtime.preemption import INTERRUPTED_EXIT, PREEMPTED_EXIT


def first_reported_error(failures: dict) -> tuple[str, int] | None:
    """(message, exit code) of the earliest rank that failed with a reported error, or None."""
    found = [
        (f.error_file_data.get("ndparallel", {}).get("time", f.timestamp), rank, f.message, f.exitcode)
        for rank, f in failures.items()
        if f.exitcode > 0
        and isinstance(f.error_file_data, dict)
        and isinstance(f.error_file_data.get("ndparallel"), dict)
    ]
    return min(found)[2:] if found else None


def _exit_text(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"exit {code}"
    return f"exit {code}"


def describe_failure(failures: dict, first_rank: int) -> list[str]:
    """The launcher's lines for a failed job (``failures``: rank → ``ProcessFailure``)."""
    first = failures[first_rank]
    others = ", ".join(
        f"rank {rank} ({_exit_text(f.exitcode)})"
        for rank, f in sorted(failures.items())
        if rank != first_rank
    )
    lines = [
        f"ndparallel launch: job failed: rank {first_rank} (exit {first.exitcode}) failed first"
        + (f"; then {others}" if others else "")
    ]
    later = {r: f for r, f in failures.items() if r != first_rank}
    hung = sorted(r for r, f in later.items() if f.exitcode == -signal.SIGKILL)
    stopped = sorted(r for r, f in later.items() if f.exitcode == -signal.SIGTERM)
    if hung and first.exitcode != -signal.SIGKILL:
        lines.append(
            f"ndparallel launch: ranks {hung} hung: they did not stop when asked (SIGTERM) and "
            "had to be killed (SIGKILL): stopped, or stuck outside any collective; the others "
            "failed waiting for them"
        )
    elif stopped and first.exitcode == 1:
        lines.append(
            f"ndparallel launch: ranks {stopped} were still running when rank {first_rank} "
            "failed (stopped by the launcher): if it timed out in a collective, the rank that "
            "hung is among them"
        )
    return lines


def report_failure(exc, node_watch=None) -> int:
    """Print the summary of a ``ChildFailedError`` once; returns the launcher's exit code: a
    rank's reported input error code, ``PREEMPTED_EXIT`` / ``INTERRUPTED_EXIT`` when the ranks
    stopped for a signal (they printed why), else 1."""
    reported = first_reported_error(exc.failures)
    if reported is not None:
        print(reported[0], file=sys.stderr)
        return reported[1]
    first_rank, first = exc.get_first_failure()
    if first.exitcode in (PREEMPTED_EXIT, INTERRUPTED_EXIT):
        return first.exitcode
    for line in describe_failure(exc.failures, first_rank):
        print(line, file=sys.stderr)
    if node_watch is not None:
        for line in node_watch.diagnose(own_ranks=set(exc.failures)):
            print(line, file=sys.stderr)
    return 1
