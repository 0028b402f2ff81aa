"""The launcher under faults and signals, with a cheap torch-only job (``scripts/signal_job.py``):
a stopped (SIGSTOP) rank is the one named; ranks die with a ``kill -9``-ed launcher; on two
"nodes" the survivor names the node that died; SIGUSR1 to the launcher or to one rank stops every
rank after the same step (exit 75); the preemption deadline ends a stuck stop with exit 75, saying
so."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cli_helpers import c10d_nodes
from ndparallel.runtime.multirank import free_port
from ndparallel.runtime.preemption import PREEMPTED_EXIT

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = Path(__file__).parent / "scripts" / "signal_job.py"
WAIT_S = 180

pytestmark = pytest.mark.skipif(not Path("/proc").is_dir(), reason="needs /proc (Linux)")


def _env(**extra: str) -> dict:
    return {
        **os.environ,
        "NDPARALLEL_TIMEOUT": "20",
        "NDPARALLEL_DEVICE": "cpu",
        "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
        **extra,
    }


def _launch(*args: str, **popen) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "ndparallel", "launch", *args],
        env=popen.pop("env", _env()),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **popen,
    )


def _wait_for(paths: list[Path], procs: list[subprocess.Popen]) -> None:
    deadline = time.monotonic() + WAIT_S
    while not all(p.exists() for p in paths):
        assert all(p.poll() is None for p in procs), [
            p.communicate()[1][-2000:] for p in procs if p.poll() is not None
        ]
        assert time.monotonic() < deadline, f"the ranks did not start within {WAIT_S} s"
        time.sleep(0.05)


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _wait_gone(pids: list[int], within_s: float) -> bool:
    end = time.monotonic() + within_s
    while any(_alive(p) for p in pids) and time.monotonic() < end:
        time.sleep(0.05)
    return not any(_alive(p) for p in pids)


def _parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


@pytest.mark.timeout(300)  # a real multi-rank launch, 40-95 s on 2 cores: over the 120 s default budget
def test_stopped_rank_is_the_one_named(tmp_path):
    """Rank 1 of 3 stops itself (SIGSTOP): its peers time out in the next collective and are
    stopped; rank 1 ignores SIGTERM and is killed 30 s later (torch's grace) — it is the one named."""
    proc = _launch(
        "--nproc-per-node", "3", str(SCRIPT), "stop-rank-1", str(tmp_path), env=_env(NDPARALLEL_TIMEOUT="3")
    )
    _, err = proc.communicate(timeout=WAIT_S)
    assert proc.returncode == 1
    assert "ndparallel launch: ranks [1] hung: they did not stop when asked (SIGTERM)" in err, err[-3000:]
    assert not re.search(r"ranks \[[0-9, ]*[02][0-9, ]*\] hung", err)  # never the peers that waited
    assert not list(tmp_path.glob("finished-*"))


def test_ranks_die_with_a_killed_launcher(tmp_path):
    proc = _launch("--nproc-per-node", "2", str(SCRIPT), "loop", str(tmp_path))
    _wait_for([tmp_path / "pid-0", tmp_path / "pid-1"], [proc])
    ranks = [int((tmp_path / f"pid-{r}").read_text()) for r in (0, 1)]
    assert all(_parent(p) == proc.pid for p in ranks)
    proc.kill()  # SIGKILL: no chance to stop its ranks itself
    proc.communicate(timeout=30)
    assert _wait_gone(ranks, within_s=10), "ranks outlived their launcher"


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def test_a_dead_node_ends_the_other_which_names_it(tmp_path):
    """Two launchers (1 rank each, c10d rendezvous on 127.0.0.1): ``kill -9`` of the second —
    its rank dies with it; the first ends within the collective timeout, naming that node."""
    port = free_port()
    rdzv = c10d_nodes(1, f"127.0.0.1:{port}", "dead-node")
    first = _launch(*rdzv, str(SCRIPT), "loop", str(tmp_path))
    deadline = time.monotonic() + WAIT_S
    while not _listening(port):  # the first launcher hosts the rendezvous store
        assert first.poll() is None and time.monotonic() < deadline, first.communicate()[1][-2000:]
        time.sleep(0.05)
    second = _launch(*rdzv, str(SCRIPT), "loop", str(tmp_path))
    _wait_for([tmp_path / "pid-0", tmp_path / "pid-1"], [first, second])
    ranks = {r: int((tmp_path / f"pid-{r}").read_text()) for r in (0, 1)}
    dead_rank = next(r for r, pid in ranks.items() if _parent(pid) == second.pid)
    time.sleep(2.5)  # the launchers have published their ranks (one heartbeat a second)
    second.kill()
    killed = time.monotonic()
    assert _wait_gone([ranks[dead_rank]], within_s=10)
    _, err = first.communicate(timeout=WAIT_S)
    assert first.returncode == 1 and time.monotonic() - killed < 20 + 30, err[-3000:]  # timeout + teardown
    assert (
        f"ndparallel launch: node with rank {dead_rank} on {socket.gethostname()} (launcher pid "
        f"{second.pid}) stopped responding"
    ) in err, err[-3000:]
    second.communicate(timeout=30)


@pytest.mark.parametrize("target", ["launcher", "rank 1"])
def test_sigusr1_stops_every_rank_after_the_same_step(tmp_path, target):
    """SIGUSR1 (SLURM's ``--signal=USR1@120``) to the launcher — forwarded to the ranks — or to one
    rank (the ranks agree, exit 75, the launcher passes 75 on): exit 75, every rank stopped after
    the same step, no traceback."""
    proc = _launch("--nproc-per-node", "2", str(SCRIPT), "preempt", str(tmp_path))
    _wait_for([tmp_path / "ready-0", tmp_path / "ready-1"], [proc])
    pid = proc.pid if target == "launcher" else int((tmp_path / "pid-1").read_text())
    os.kill(pid, signal.SIGUSR1)
    _, err = proc.communicate(timeout=WAIT_S)
    assert proc.returncode == PREEMPTED_EXIT, err[-3000:]
    stopped = [(tmp_path / f"stopped-{r}").read_text().split(" ", 1) for r in (0, 1)]
    assert stopped[0][0] == stopped[1][0]  # the same step
    assert "SIGUSR1" in (stopped[0][1] if target == "launcher" else stopped[1][1])
    assert "Traceback" not in err


_DEADLINE = """
import os, signal, sys, time
sys.path.insert(0, {src!r})
from ndparallel.runtime.preemption import PreemptionWatch
with PreemptionWatch(timeout_s=1.0, name="job") as watch:
    os.kill(os.getpid(), signal.SIGTERM)
    assert watch.should_stop()
    watch.step = 7
    os.kill(os.getpid(), signal.SIGUSR1)  # a second signal while stopping: ignored
    time.sleep(60)  # a checkpoint that never finishes
"""


def test_preemption_deadline_exits_without_a_checkpoint_saying_so():
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-c", _DEADLINE.format(src=str(ROOT / "src"))],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == PREEMPTED_EXIT and time.monotonic() - started < 30
    assert proc.stderr.splitlines() == [
        "job: SIGUSR1 received while stopping for SIGTERM: ignored (the checkpoint in progress completes, "
        "or is left without a COMPLETE marker)",
        "job: preempted (SIGTERM) at step 7: no checkpoint within preemption_timeout_s=1: exiting without "
        "one "
        f"(exit {PREEMPTED_EXIT}); the newest complete checkpoint stays the resume point",
    ]
