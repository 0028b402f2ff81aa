"""``bench/gpu_checkpoint_async.py --tiny``: the GPU checkpoint benchmark's logic on CPU — every
mode runs, every checkpoint it writes is complete, the JSON and the HEADLINE line come out."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_checkpoint_async_tiny(tmp_path):
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(ROOT / "src")}
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_checkpoint_async.py"), "--tiny",
                          "--out", str(tmp_path)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1].startswith("HEADLINE: a save costs")
    results = json.loads((tmp_path / "gpu_checkpoint_async_tiny.json").read_text())["results"]
    by = {r["mode"]: r for r in results}
    assert list(by) == ["no saves", "preemption check", "sync saves", "async saves"]
    assert by["sync saves"]["saves"] == by["async saves"]["saves"] == 1
    assert by["async saves"]["staged_mb"] > 0 and by["preemption check"]["check_s_median"] > 0
    assert by["sync saves"]["problems"] == by["async saves"]["problems"] == []
