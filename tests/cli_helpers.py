"""Running the ``ndparallel`` command line in the pytest process (fast: no interpreter start-up)."""

from __future__ import annotations


def c10d_nodes(nproc_per_node: int, endpoint: str, rdzv_id: str | None = None, nnodes: int = 2) -> list[str]:
    """torchrun's flags (``ndparallel launch`` takes the same) for one of ``nnodes`` nodes meeting
    in a c10d rendezvous at ``endpoint`` (``host:port``)."""
    flags = ["--nnodes", str(nnodes), "--nproc-per-node", str(nproc_per_node)]
    flags += ["--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint]
    return flags + (["--rdzv-id", rdzv_id] if rdzv_id else [])


def run_cli(capsys, *args) -> tuple[int, str, str]:
    """``ndparallel ARGS`` in-process: (exit code, stdout, stderr). What the test printed before
    (its own setup, progress bars) is dropped first."""
    from ndparallel.cli import main

    capsys.readouterr()
    code = main([str(a) for a in args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def run_cli_fd(capfd, *args) -> tuple[int, str, str]:
    """``run_cli`` with pytest's ``capfd``: the output of the child processes the command starts
    (which write to the inherited file descriptors) is captured too."""
    from ndparallel.cli import main

    capfd.readouterr()
    code = main([str(a) for a in args])
    captured = capfd.readouterr()
    return code, captured.out, captured.err


def run_cli_recorded(*args):
    """``run_cli`` with the output of the child processes too, split by origin: (exit code, an
    ``output_origin.Output``: ``stdout``, ``stderr``, ``foreign()`` — the lines ndparallel did not write)."""
    from ndparallel.cli import main
    from output_origin import recorded_output

    with recorded_output() as output:
        code = main([str(a) for a in args])
    return code, output


def forbid_launch(monkeypatch) -> None:
    """Make starting ranks fail the test at once (a case that must be refused before launch), with
    no Hub access and no inherited rank variables."""
    import ndparallel.runtime.launch as launch

    def refuse(*a, **k):
        raise AssertionError(f"ranks were launched: {a}")

    monkeypatch.setattr(launch, "relaunch_self", refuse)
    monkeypatch.setattr(launch, "run_here", refuse)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)


def train_on_forked_ranks(args, cwd=None, env=None, timeout_s: float = 600.0):
    """``ndparallel train ARGS`` with its ranks forked from this process instead of launched: the
    command's own checks and notes run here, then each rank runs the rank side of the same command
    (``RANK``/``WORLD_SIZE`` set, as the launcher sets them), having torch and transformers already
    imported — ~15 s of CPU less than three fresh interpreters and an elastic agent. For tests of
    what a run does (configs, data, outputs); the launcher itself is tested with real launches.
    Returns a ``subprocess.CompletedProcess`` with this command's and every rank's output, and as
    ``foreign`` the lines of it that ndparallel did not write (``output_origin.py``)."""
    import os
    import subprocess

    import ndparallel.runtime.launch as launch
    from ndparallel.cli import main
    from output_origin import recorded_output

    args = [str(a) for a in args]
    real_relaunch, old_cwd, old_env = launch.relaunch_self, os.getcwd(), dict(os.environ)
    launch.relaunch_self = lambda n, module_args, torchrun_args=(): _fork_ranks(n, module_args, timeout_s)
    try:
        with recorded_output() as output:
            os.environ.update({"HF_HUB_OFFLINE": "1", **(env or {})})
            if cwd is not None:
                os.chdir(cwd)
            code = main(args)
    finally:
        launch.relaunch_self = real_relaunch
        os.chdir(old_cwd)
        os.environ.clear()
        os.environ.update(old_env)
    proc = subprocess.CompletedProcess(["ndparallel", *args], code, output.stdout, output.stderr)
    proc.foreign = output.foreign()
    return proc


def _fork_ranks(world: int, module_args, timeout_s: float) -> int:
    """``python -m ndparallel MODULE_ARGS`` as ``world`` forked ranks; the first non-zero exit code
    (a failed rank's peers get 30 s, then SIGKILL, as the launcher's agent would stop them)."""
    import os
    import signal
    import time

    import torch.distributed as dist

    from ndparallel.runtime.multirank import free_port

    assert not dist.is_initialized(), "fork the ranks from a process without a process group"
    port, pids = free_port(), []
    for rank in range(world):
        pid = os.fork()
        if pid == 0:
            _rank_child(rank, world, port, list(module_args))
        pids.append(pid)
    codes: dict[int, int] = {}
    deadline, first_failure = time.monotonic() + timeout_s, None
    while len(codes) < world:
        for pid in pids:
            if pid in codes:
                continue
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                codes[pid] = os.waitstatus_to_exitcode(status)
                if codes[pid] != 0 and first_failure is None:
                    first_failure = codes[pid]
                    deadline = min(deadline, time.monotonic() + 30)
        if time.monotonic() > deadline:
            for pid in set(pids) - set(codes):
                os.kill(pid, signal.SIGKILL)
                codes[pid] = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
            first_failure = first_failure if first_failure is not None else 124  # (timed out)
        time.sleep(0.05)
    return first_failure or 0


def _rank_child(rank: int, world: int, port: int, module_args) -> None:
    import os
    import sys
    import traceback

    code = 1
    try:
        import torch

        from ndparallel.runtime.launch import LAUNCHED_ENV
        from ndparallel.runtime.multirank import _fresh_tqdm_locks

        torch.set_num_threads(1)  # (forked ranks with several OpenMP threads were seen to hang)
        _fresh_tqdm_locks()
        os.environ.update(
            RANK=str(rank),
            WORLD_SIZE=str(world),
            LOCAL_RANK=str(rank),
            LOCAL_WORLD_SIZE=str(world),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            **{LAUNCHED_ENV: "1"},
        )
        from ndparallel.cli import main

        assert module_args[0] == "train", module_args
        code = main(module_args)
        record = os.environ.get("NDPARALLEL_RECORD_MODULES")  # tests/scripts/record_rank_modules.py
        if record and rank == 0:
            with open(record, "w") as listing:
                listing.write("\n".join(sys.modules))
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:  # noqa: BLE001 - a rank's crash is shown, as the launcher shows it
        traceback.print_exc()
    finally:
        sys.stdout.flush(), sys.stderr.flush()
        os._exit(code)
