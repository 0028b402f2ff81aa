"""Start the ranks of a job on this machine through torch's elastic agent (torch.distributed.run).

``ndparallel launch`` accepts every ``torchrun`` option, so the same command scales to several
nodes (``--nnodes 2 --node-rank 0 --rdzv-endpoint host:29500``). What it adds: ``--standalone`` on a
single node when no rendezvous is given (a free port, no clashes between jobs) and, on CPU, a
per-rank thread count that shares this machine's cores instead of oversubscribing them.
"""

from __future__ import annotations

import os
import signal
import sys
from typing import Sequence

import torch


def torchrun_parser():
    from torch.distributed.run import get_args_parser

    parser = get_args_parser()
    parser.prog = "ndparallel launch"
    return parser


def threads_per_rank(nproc_per_node: int, cpu_count: int | None = None) -> int:
    """CPU threads each local rank may use so that all ranks together fill the cores once."""
    cores = cpu_count or os.cpu_count() or 1
    return max(1, cores // max(1, nproc_per_node))


def launch(argv: Sequence[str]) -> int:
    """Parse torchrun-style ``argv`` (``[options] script [args]``), run the job, return an exit code."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import run

    args = torchrun_parser().parse_args(list(argv))
    single_node = str(args.nnodes) in ("1", "1:1")
    if single_node and not args.rdzv_endpoint and args.rdzv_backend == "static":
        args.standalone = True
    nproc = args.nproc_per_node
    if str(nproc).isdigit() and "OMP_NUM_THREADS" not in os.environ and not torch.cuda.is_available():
        os.environ["OMP_NUM_THREADS"] = str(threads_per_rank(int(nproc)))
    try:
        run(args)
    except ChildFailedError as exc:
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
    return 0


def relaunch_self(nproc_per_node: int, module_args: Sequence[str], torchrun_args: Sequence[str] = ()) -> int:
    """Run ``python -m ndparallel <module_args>`` on ``nproc_per_node`` local ranks."""
    argv = [*torchrun_args, f"--nproc-per-node={nproc_per_node}", "-m", "ndparallel", *module_args]
    return launch(argv)
