"""A rank that raises, or hangs, while its peers wait in a collective: every rank is gone within the
collective timeout, the job exits non-zero and names the rank that failed first."""

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parent / "scripts" / "fault_collective.py"
TIMEOUT_S = 5  # the hang case waits it out; 3 ranks start within it (test_faults_launcher: 3 s)


def _run(mode: str, tmp_path: Path):
    env = {**os.environ, "NDPARALLEL_TIMEOUT": str(TIMEOUT_S)}
    cmd = [
        sys.executable,
        "-m",
        "ndparallel",
        "launch",
        "--nproc-per-node",
        "3",
        str(SCRIPT),
        mode,
        str(tmp_path),
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    return proc, time.time()


@pytest.mark.parametrize("mode", ["raise", "hang"])
def test_misbehaving_rank_ends_the_job_within_the_timeout(mode, tmp_path):
    proc, ended = _run(mode, tmp_path)
    started = float((tmp_path / "misbehaving").read_text())
    assert proc.returncode != 0
    assert not list(tmp_path.glob("finished-*")), "a rank got past the broken collective"
    # the raising rank is the first failure; when a rank hangs, its peers' timeouts fail first
    first = "rank 1" if mode == "raise" else "failed first"
    assert "ndparallel launch: job failed:" in proc.stderr and first in proc.stderr, proc.stderr[-3000:]
    if mode == "raise":
        assert "rank 1 fails on purpose" in proc.stderr
    else:  # the stalled rank is named (a peer whose own timeout had not fired yet may be too)
        found = re.search(r"ranks \[([0-9, ]+)\] were still running", proc.stderr)
        assert found and "1" in found.group(1).split(", "), proc.stderr[-3000:]
    assert ended - started < TIMEOUT_S + 30, ended - started  # timeout + teardown, never a hang
