"""``bench/gpu_long_context.py --cpu-smoke`` runs the GPU script's logic on CPU (what ``bench/gpu_all.sh
--cpu-smoke`` runs): the exactness checks pass, every memory row and the planner's answer come back,
the JSON lands in ``--out`` (not in the source tree)."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_long_context_cpu_smoke(tmp_path):
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(ROOT / "src")}
    out = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "gpu_long_context.py"),
            "--cpu-smoke",
            "--seqs",
            "128",
            "--steps",
            "1",
            "--out",
            str(tmp_path),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert "HEADLINE: exact=yes" in out.stdout, out.stdout[-2000:]
    result = json.loads((tmp_path / "gpu_long_context.json").read_text())
    assert result["exactness"]["offload_max_abs"] == 0.0
    assert [r["config"] for r in result["rows"]] == [
        "checkpointing",
        "ckpt + tiled",
        "ckpt + tiled + offload",
    ]
    assert result["rows"][-1]["host_GiB"] > 0
    assert result["planner_8b_h200_longest"]["lora_r16"] > 0
