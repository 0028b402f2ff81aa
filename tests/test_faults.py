"""Faults under ``ndparallel launch``: a SIGKILLed rank takes the whole job down within the
collective timeout, naming the rank; with ``--max-restarts 1`` the job restarts, resumes from the
newest complete checkpoint and ends with the uninterrupted run's loss."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ndparallel.runtime.multirank import run_on_ranks

sys.path.insert(0, str(Path(__file__).parent / "scripts"))
import ckpt_train  # noqa: E402

SCRIPT = Path(__file__).parent / "scripts" / "ckpt_train.py"
TIMEOUT_S = 20


def _launch(out: Path, *args: str, restarts: int = 0) -> subprocess.CompletedProcess:
    env = {**os.environ, "NDPARALLEL_TIMEOUT": str(TIMEOUT_S), "NDPARALLEL_DEVICE": "cpu"}
    cmd = [
        sys.executable,
        "-m",
        "ndparallel",
        "launch",
        "--nproc-per-node",
        "2",
        "--max-restarts",
        str(restarts),
        str(SCRIPT),
        str(out),
        *args,
    ]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)


def _processes_mentioning(text: str) -> list[int]:
    pids = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if text in (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"):
                    pids.append(int(d.name))
            except OSError:
                pass
    return pids


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="needs /proc to look for leftover ranks")
def test_sigkill_of_one_rank_fails_the_job_fast(tmp_path):
    out, marker = tmp_path / "run", tmp_path / "killed"
    proc = _launch(out, "--steps", "6", "--kill-at", "2", "--kill-rank", "1", "--marker", str(marker))
    done = time.time()
    assert marker.exists(), proc.stderr[-3000:]
    assert proc.returncode != 0
    assert "rank 1 (exit -9)" in proc.stderr, proc.stderr[-3000:]
    assert done - marker.stat().st_mtime < TIMEOUT_S  # every rank gone within the timeout
    assert _processes_mentioning(str(out)) == []
    # The checkpoint written before the kill is complete; nothing after it exists.
    assert [p.name for p in sorted(out.glob("checkpoint-*"))] == ["checkpoint-1", "checkpoint-2"]


def test_max_restarts_resumes_from_latest_checkpoint(tmp_path):
    reference = run_on_ranks(ckpt_train.train, 2, {"dp_shard_size": 2}, str(tmp_path / "ref"))[0]["losses"]
    out, marker = tmp_path / "run", tmp_path / "killed"
    proc = _launch(out, "--steps", "4", "--kill-at", "2", "--marker", str(marker), restarts=1)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert marker.exists()  # the first attempt did die
    losses = {int(k): v for k, v in json.loads((out / "losses.json").read_text()).items()}
    assert sorted(losses) == [3, 4]  # the second attempt resumed after step 2
    assert losses[4] == pytest.approx(reference[4], rel=1e-6, abs=0)
    assert [p.name for p in sorted(out.glob("checkpoint-*"))] == ["checkpoint-3", "checkpoint-4"]
