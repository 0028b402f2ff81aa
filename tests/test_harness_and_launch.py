"""The multi-rank test harness and the launcher."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ndparallel.runtime.launch import threads_per_rank
from ndparallel.testing import RankFailure, run_on_ranks

ROOT = Path(__file__).resolve().parents[1]


def _allreduce_rank():
    import torch
    import torch.distributed as dist

    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t)
    return t.item(), torch.get_num_threads()


def test_results_by_rank():
    out = run_on_ranks(_allreduce_rank, 4)
    assert [o[0] for o in out] == [6.0] * 4
    assert all(o[1] == 1 for o in out)


def _raise_on_rank_one():
    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise ValueError("boom on purpose")
    dist.barrier()  # the others wait for rank 1 forever: the harness must not hang
    return "unreachable"


def test_raising_rank_fails_fast_with_its_traceback():
    start = time.monotonic()
    with pytest.raises(RankFailure, match=r"rank 1 of 3 raised[\s\S]*boom on purpose"):
        run_on_ranks(_raise_on_rank_one, 3, timeout_s=60)
    assert time.monotonic() - start < 30


def _hang():
    time.sleep(600)


def test_hanging_ranks_are_killed_at_the_deadline():
    start = time.monotonic()
    with pytest.raises(RankFailure, match=r"ranks \[0, 1\] of 2 did not finish within 1 s"):
        run_on_ranks(_hang, 2, timeout_s=1)
    assert time.monotonic() - start < 30


def _progress_bar() -> int:
    from tqdm.auto import tqdm

    return sum(tqdm(range(3), disable=False, file=sys.stderr))


def test_a_tqdm_lock_held_in_the_parent_at_fork_does_not_hang_the_ranks():
    """tqdm's monitor thread in the parent takes the bar lock every 10 s; a fork in that instant
    copies the held lock. Here a parent thread holds it across the fork: the ranks' bars still run
    (without fresh locks in the child they wait forever and the 30 s deadline fails the test)."""
    import threading

    from tqdm.auto import tqdm

    held, release = threading.Event(), threading.Event()

    def hold():
        with tqdm.get_lock():
            held.set()
            release.wait(60)

    holder = threading.Thread(target=hold, daemon=True)
    holder.start()
    held.wait(10)
    try:
        assert run_on_ranks(_progress_bar, 2, timeout_s=30) == [3, 3]
    finally:
        release.set()
        holder.join(10)


def test_threads_per_rank():
    assert threads_per_rank(8, cpu_count=2) == 1
    assert threads_per_rank(2, cpu_count=16) == 8


def _run_cli(*args, timeout=180):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.run(
        [sys.executable, "-m", "ndparallel", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env=env,
    )


def test_launch_prints_every_rank_coordinates():
    out = _run_cli("launch", "--nproc-per-node", "4", "examples/show_mesh.py", "--cp", "2")
    assert out.returncode == 0, out.stderr[-3000:]
    for r in range(4):
        assert f"rank {r}: " in out.stdout
    assert "rank 3: pp=0 dp_replicate=0 dp_shard=1 cp=1 tp=0" in out.stdout
    assert "[FSDP 2 + CP 2]" in out.stdout


def test_launch_reports_failure(tmp_path):
    script = tmp_path / "fail.py"
    script.write_text("import os, sys\nsys.exit(3 if os.environ['RANK'] == '1' else 0)\n")
    out = _run_cli("launch", "--nproc-per-node", "2", str(script))
    assert out.returncode == 1
    assert "rank 1 (exit 3)" in out.stderr


def test_cli_unknown_command():
    out = _run_cli("frobnicate")
    assert out.returncode == 2 and "unknown command" in out.stderr


def test_free_port_lies_below_the_ephemeral_range():
    """A rendezvous port chosen for later is one bind(0) and gloo's own sockets never hand out."""
    import socket

    from ndparallel.runtime.multirank import free_port

    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    ports = {free_port() for _ in range(5)}
    assert all(1024 <= p < low for p in ports) and len(ports) > 1, (ports, low)
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports.pop()))  # free indeed
