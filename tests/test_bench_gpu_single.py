"""``bench/gpu_single.py --tiny`` runs the GPU benchmark's logic on CPU: every variant builds,
trains and reports a row (fp8 reports why it is skipped where the hardware lacks it)."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_single_tiny_runs_every_variant(tmp_path):
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_single.py"), "--tiny", "--seqs", "32",
                          "--name", "gpu_single_tiny_test"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=500)
    assert out.returncode == 0, out.stderr[-3000:]
    for row in ("accelerate", "nd bf16", "nd + chunked loss", "nd + compile", "nd + fp8"):
        assert row in out.stdout, out.stdout
    results = json.loads((ROOT / "bench" / "results" / "gpu_single_tiny_test.json").read_text())["results"]["32"]
    for name in ("accelerate", "nd bf16", "nd + chunked loss", "nd + compile"):
        assert results[name]["tokens_per_s"] > 0, results[name]
    assert "skipped" in results["nd + fp8"] or results["nd + fp8"]["tokens_per_s"] > 0
