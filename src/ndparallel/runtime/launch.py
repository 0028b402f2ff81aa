"""Start the ranks of a job on this machine through torch's elastic agent (torch.distributed.run).

``ndparallel launch`` accepts every ``torchrun`` option, so the same command scales to several
nodes (``--nnodes 2 --node-rank 0 --rdzv-endpoint host:29500``). What it adds: ``--standalone`` on a
single node when no rendezvous is given (a free port, no clashes between jobs) and, on CPU, a
per-rank thread count that shares this machine's cores instead of oversubscribing them.

Input errors found on the ranks (bad data, weights, output_dir, ...) exit with code 2 and hand their
one-line message to this launcher through the elastic agent's per-rank error file
(``report_rank_error``); the launcher prints the first failing rank's line once and exits 2 — no
line per rank, no "job failed" summary. Other failures keep their tracebacks and exit 1.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import time
from typing import Sequence

import torch

INPUT_ERROR_EXIT = 2
LAUNCHED_ENV = "NDPARALLEL_LAUNCHED"  # set for the ranks this launcher starts
_NPROC_WORDS = ("auto", "cpu", "gpu", "xpu")


def torchrun_parser():
    from torch.distributed.run import get_args_parser

    parser = get_args_parser()
    parser.prog = "ndparallel launch"

    def error(message: str):  # a usage error in one line, exit 2 (not torchrun's usage block)
        parser.exit(INPUT_ERROR_EXIT, f"ndparallel launch: error: {message} (see ndparallel launch -h)\n")

    parser.error = error  # type: ignore[method-assign]
    return parser


def launched_by_ndparallel() -> bool:
    """True on a rank started by this launcher (it checked the inputs and reports rank errors)."""
    return os.environ.get(LAUNCHED_ENV) == "1"


def report_rank_error(line: str) -> None:
    """On a rank: an error meant for the user (bad input, a diverged run), as one line. Written to
    the elastic agent's error file for this rank, from which the launcher prints the first failing
    rank's line once and exits with that rank's code; printed here only where no ndparallel
    launcher will (plain ``torchrun``: by rank 0)."""
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if error_file:
        try:
            with open(error_file, "w") as f:
                json.dump({"message": line, "timestamp": int(time.time()),
                           "ndparallel": {"input_error": True, "time": time.time()}}, f)
        except OSError:
            error_file = None
    if not (error_file and launched_by_ndparallel()) and os.environ.get("RANK", "0") == "0":
        print(line, file=sys.stderr)


def first_reported_error(failures: dict) -> tuple[str, int] | None:
    """(message, exit code) of the earliest rank that failed with a reported error, or None."""
    found = [(f.error_file_data.get("ndparallel", {}).get("time", f.timestamp), rank, f.message, f.exitcode)
             for rank, f in failures.items()
             if f.exitcode > 0 and isinstance(f.error_file_data, dict)
             and isinstance(f.error_file_data.get("ndparallel"), dict)]
    return min(found)[2:] if found else None


def _nproc_problem(nproc: str) -> str | None:
    text = str(nproc)
    if text.lstrip("-").isdigit():
        return None if int(text) >= 1 else f"--nproc-per-node must be >= 1, got {text}"
    if text not in _NPROC_WORDS:
        return f"--nproc-per-node must be a number >= 1 or one of {', '.join(_NPROC_WORDS)}, got {text!r}"
    if text == "gpu" and not torch.cuda.is_available():
        return "--nproc-per-node gpu, but there is no CUDA GPU here: give a number of ranks"
    return None


class _DropPerRankNoise(logging.Filter):
    """The agent's per-rank "failed (exitcode: …)" and "closing signal" lines repeat what the
    launcher's own summary (or the rank's one-line input error) says."""

    def filter(self, record: logging.LogRecord) -> bool:
        msg = str(record.msg)
        return not (msg.startswith("failed (exitcode") or "closing signal" in msg)


def threads_per_rank(nproc_per_node: int, cpu_count: int | None = None) -> int:
    """CPU threads each local rank may use so that all ranks together fill the cores once."""
    cores = cpu_count or os.cpu_count() or 1
    return max(1, cores // max(1, nproc_per_node))


def launch(argv: Sequence[str]) -> int:
    """Parse torchrun-style ``argv`` (``[options] script [args]``), run the job, return an exit code."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import run

    args = torchrun_parser().parse_args(list(argv))
    problem = _nproc_problem(args.nproc_per_node)
    if problem:
        print(f"ndparallel launch: error: {problem}", file=sys.stderr)
        return INPUT_ERROR_EXIT
    single_node = str(args.nnodes) in ("1", "1:1")
    if single_node and not args.rdzv_endpoint and args.rdzv_backend == "static":
        args.standalone = True
    nproc = args.nproc_per_node
    if str(nproc).isdigit() and "OMP_NUM_THREADS" not in os.environ and not torch.cuda.is_available():
        os.environ["OMP_NUM_THREADS"] = str(threads_per_rank(int(nproc)))
    noise = _DropPerRankNoise()
    agent_log = logging.getLogger("torch.distributed.elastic.multiprocessing.api")
    agent_log.addFilter(noise)
    try:
        run(args)
    except ValueError as exc:  # torchrun's own checks of its arguments
        print(f"ndparallel launch: error: {exc}", file=sys.stderr)
        return INPUT_ERROR_EXIT
    except ChildFailedError as exc:
        reported = first_reported_error(exc.failures)
        if reported is not None:
            print(reported[0], file=sys.stderr)
            return reported[1]
        first_rank, first = exc.get_first_failure()
        others = ", ".join(f"rank {rank} (exit {f.exitcode})"
                           for rank, f in sorted(exc.failures.items()) if rank != first_rank)
        print(f"ndparallel launch: job failed: rank {first_rank} (exit {first.exitcode}) failed first"
              + (f"; then {others}" if others else ""), file=sys.stderr)
        stopped = sorted(r for r, f in exc.failures.items() if f.exitcode == -signal.SIGTERM)
        if stopped and first.exitcode == 1:
            print(f"ndparallel launch: ranks {stopped} were still running when rank {first_rank} "
                  "failed (stopped by the launcher): if it timed out in a collective, they are the "
                  "ranks that stalled", file=sys.stderr)
        return 1
    finally:
        agent_log.removeFilter(noise)
    return 0


def relaunch_self(nproc_per_node: int, module_args: Sequence[str], torchrun_args: Sequence[str] = ()) -> int:
    """Run ``python -m ndparallel <module_args>`` on ``nproc_per_node`` local ranks."""
    argv = [*torchrun_args, f"--nproc-per-node={nproc_per_node}", "-m", "ndparallel", *module_args]
    previous = os.environ.get(LAUNCHED_ENV)
    os.environ[LAUNCHED_ENV] = "1"  # the ranks inherit it: they leave input errors to this launcher
    try:
        return launch(argv)
    finally:
        if previous is None:
            os.environ.pop(LAUNCHED_ENV, None)
        else:
            os.environ[LAUNCHED_ENV] = previous
