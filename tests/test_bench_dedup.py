"""``bench/dedup_memory.py`` runs (tiny N): the deduplication keeps exactly the distinct rows of its
generated table and the JSON lands in ``$BENCH_RESULTS_DIR`` (measured: bench/reference/benchmarks_log.md)."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_dedup_memory_bench_runs(tmp_path):
    env = {**os.environ, "BENCH_RESULTS_DIR": str(tmp_path)}
    out = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "dedup_memory.py"), "--samples", "3000"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    result = json.loads((tmp_path / "dedup_memory.json").read_text())
    small, large = result["rows"]
    assert (small["samples"], large["samples"]) == (3000, 30000)
    assert 0.85 * large["samples"] < large["distinct"] < large["samples"]  # a tenth are repeats
    assert result["bytes_per_distinct_sample"] > 16  # at least the digest itself
