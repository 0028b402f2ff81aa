"""Start the ranks of a job on this machine through torch's elastic agent (torch.distributed.run).

``ndparallel launch`` accepts every ``torchrun`` option, so the same command scales to several
nodes (``--nnodes 2 --node-rank 0 --rdzv-endpoint host:29500``). What it adds: ``--standalone`` on a
single node when no rendezvous is given (a free port, no clashes between jobs) and, on CPU, a
per-rank thread count that shares this machine's cores instead of oversubscribing them; SIGUSR1
among the signals forwarded to the ranks and a shutdown grace long enough for a preemption
checkpoint (``configure_signals``); a launcher signalled with SIGTERM/SIGUSR1 exits with
``PREEMPTED_EXIT`` (75), after Ctrl-C with 130, without tracebacks; ranks that die with it
(``lifeline.py``); on several nodes, a heartbeat per node that names a node that went away
(``nodes.py``); and a failure summary naming the rank that failed first and the ranks that hung
(``failures.py``).

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
import threading
import time
from collections.abc import Callable, Sequence

from ndparallel.runtime.failures import report_failure
from ndparallel.runtime.lifeline import LAUNCHER_PID_ENV
from ndparallel.runtime.nodes import node_watch_for
from ndparallel.runtime.preemption import DEFAULT_TIMEOUT_S as DEFAULT_PREEMPTION_TIMEOUT_S
from ndparallel.runtime.preemption import INTERRUPTED_EXIT, PREEMPTED_EXIT, PREEMPTION_SIGNALS

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
                json.dump(
                    {
                        "message": line,
                        "timestamp": int(time.time()),
                        "ndparallel": {"input_error": True, "time": time.time()},
                    },
                    f,
                )
        except OSError:
            error_file = None
    if not (error_file and launched_by_ndparallel()) and os.environ.get("RANK", "0") == "0":
        print(line, file=sys.stderr)


def _nproc_problem(nproc: str) -> str | None:
    text = str(nproc)
    if text.lstrip("-").isdigit():
        return None if int(text) >= 1 else f"--nproc-per-node must be >= 1, got {text}"
    if text not in _NPROC_WORDS:
        return f"--nproc-per-node must be a number >= 1 or one of {', '.join(_NPROC_WORDS)}, got {text!r}"
    import torch  # heavy: imported once a launch is asked for

    if text == "gpu" and not torch.cuda.is_available():
        return "--nproc-per-node gpu, but there is no CUDA GPU here: give a number of ranks"
    return None


class _DropPerRankNoise(logging.Filter):
    """The agent's per-rank "failed (exitcode: …)", "closing signal" and "Received … death signal"
    lines repeat what the launcher's own summary (or the ranks' one line) says."""

    def filter(self, record: logging.LogRecord) -> bool:
        msg = str(record.msg)
        return not (
            msg.startswith("failed (exitcode")
            or "closing signal" in msg
            or "death signal, shutting down workers" in msg
        )


def threads_per_rank(nproc_per_node: int, cpu_count: int | None = None) -> int:
    """CPU threads each local rank may use so that all ranks together fill the cores once."""
    cores = cpu_count or os.cpu_count() or 1
    return max(1, cores // max(1, nproc_per_node))


def launch(argv: Sequence[str]) -> int:
    """Parse torchrun-style ``argv`` (``[options] script [args]``), run the job, return an exit code."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
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
    import torch  # heavy: imported once a launch is asked for

    if str(nproc).isdigit() and "OMP_NUM_THREADS" not in os.environ and not torch.cuda.is_available():
        os.environ["OMP_NUM_THREADS"] = str(threads_per_rank(int(nproc)))
    relay = configure_signals(args)
    watch = node_watch_for(args)
    noise = _DropPerRankNoise()
    agent_logs = [logging.getLogger(n) for n in _AGENT_LOGGERS]
    for log in agent_logs:
        log.addFilter(noise)
    previous_pid = os.environ.get(LAUNCHER_PID_ENV)
    os.environ[LAUNCHER_PID_ENV] = str(os.getpid())  # the ranks check they still have this parent
    try:
        if watch is not None:
            watch.start()
        run(args)
    except ValueError as exc:  # torchrun's own checks of its arguments
        print(f"ndparallel launch: error: {exc}", file=sys.stderr)
        return INPUT_ERROR_EXIT
    except SignalException as exc:  # this launcher was signalled: the agent stopped the ranks
        return _signalled(exc.sigval)
    except ChildFailedError as exc:
        return report_failure(exc, watch)
    finally:
        for log in agent_logs:
            log.removeFilter(noise)
        if previous_pid is None:
            os.environ.pop(LAUNCHER_PID_ENV, None)
        else:
            os.environ[LAUNCHER_PID_ENV] = previous_pid
        if watch is not None:
            watch.stop()
        if relay is not None:
            relay.restore()
    return 0


_AGENT_LOGGERS = (
    "torch.distributed.elastic.multiprocessing.api",
    "torch.distributed.elastic.agent.server.api",
)


def configure_signals(args) -> _PreemptionRelay | None:
    """The elastic agent forwards the signals it handles to every rank and waits ``shutdown
    timeout`` seconds for them to exit before SIGKILL. With torchrun's default list, SIGUSR1
    (SLURM's ``--signal=USR1@120``) would kill the launcher outright and a second SIGTERM would cut
    the ranks' preemption checkpoint short. So, unless the command line or the environment chose
    the signals: SIGTERM and SIGUSR1 are this launcher's (``_PreemptionRelay``: the first one is
    handed to the agent, which forwards it to the ranks; later ones are ignored) and the agent
    keeps SIGINT, SIGHUP, SIGQUIT. The shutdown grace becomes long enough for a preemption
    checkpoint (``DEFAULT_SHUTDOWN_TIMEOUT_S``) unless given."""
    relay = None
    if hasattr(args, "signals_to_handle") and "PET_SIGNALS_TO_HANDLE" not in os.environ:
        names = [n.strip() for n in str(args.signals_to_handle).split(",") if n.strip()]
        if names == list(_TORCH_DEFAULT_SIGNALS):
            if threading.current_thread() is threading.main_thread():
                relay = _PreemptionRelay()
                args.signals_to_handle = ",".join(n for n in names if n != "SIGTERM")
            else:
                args.signals_to_handle = ",".join([*names, "SIGUSR1"])
    if hasattr(args, "shutdown_timeout") and args.shutdown_timeout is None:
        args.shutdown_timeout = int(
            os.environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", DEFAULT_SHUTDOWN_TIMEOUT_S)
        )
    return relay


class _PreemptionRelay:
    """SIGTERM / SIGUSR1 to the launcher: the first is raised as the agent's ``SignalException``
    (it then sends the same signal to every rank and waits for them); later ones are ignored, so
    the ranks' checkpoint is never cut short by a repeated signal."""

    def __init__(self):
        self.first: int | None = None
        self._previous = {sig: signal.signal(sig, self._on_signal) for sig in PREEMPTION_SIGNALS}

    def _on_signal(self, signum, frame) -> None:
        from torch.distributed.elastic.multiprocessing.api import SignalException

        name = signal.Signals(signum).name
        if self.first is None:
            self.first = signum
            raise SignalException(f"Process {os.getpid()} got signal: {name}", sigval=signal.Signals(signum))
        os.write(2, f"ndparallel launch: {name} received while the ranks are stopping: ignored\n".encode())

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)


_TORCH_DEFAULT_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")
DEFAULT_SHUTDOWN_TIMEOUT_S = int(DEFAULT_PREEMPTION_TIMEOUT_S) + 20
"""How long the agent waits for signalled ranks to exit: the preemption deadline plus room to exit."""


def _signalled(sigval) -> int:
    """This launcher got ``sigval``; the agent forwarded it to the ranks and waited for them."""
    name = signal.Signals(sigval).name
    if sigval == signal.SIGINT:
        return INTERRUPTED_EXIT  # the ranks say "interrupted at step N" (rank 0), nothing more here
    code = PREEMPTED_EXIT if sigval in PREEMPTION_SIGNALS else 128 + int(sigval)
    print(
        f"ndparallel launch: {name} received: the ranks were asked to stop; exit {code}"
        + (" (preempted: run the same command again to resume)" if code == PREEMPTED_EXIT else ""),
        file=sys.stderr,
    )
    return code


def run_here(rank_main: Callable[[], int]) -> int:
    """A one-rank job in this process: no elastic agent, no second interpreter (they cost ~10 s of
    CPU a launch, the training of a small model under one). The rank's world is this process
    (``init_distributed`` makes a one-rank group on a local store); its preemption handler, Ctrl-C
    and one-line input errors are the same as under the launcher, and it cannot outlive one."""
    saved = {
        k: os.environ.pop(k)
        for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
        if k in os.environ
    }
    previous = {}
    if threading.current_thread() is threading.main_thread():  # until the trainer's own watch is up
        previous = {sig: signal.signal(sig, _preempted_before_training) for sig in PREEMPTION_SIGNALS}
    try:
        return rank_main()
    finally:
        import gc

        gc.collect()  # the run's cycles (its process group, thread pools) go now, with their threads
        for sig, handler in previous.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
        os.environ.update(saved)


def _preempted_before_training(signum, frame) -> None:
    """SIGTERM / SIGUSR1 while no preemption watch is installed (start-up, export): nothing to
    checkpoint now, so exit ``PREEMPTED_EXIT`` at once, as the launcher would."""
    os.write(
        2,
        f"ndparallel train: {signal.Signals(signum).name} received outside the training loop: "
        f"exit {PREEMPTED_EXIT} (preempted: run the same command again to resume)\n".encode(),
    )
    raise SystemExit(PREEMPTED_EXIT)


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
