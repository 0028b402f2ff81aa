"""``bench/pipeline.py`` runs, tiny: ``--quick`` measures each stage's idle fraction and peak on 2
forked gloo ranks (structure, finite, idle in [0, 1]; no timing target), and ``--one-rank-stage
--tiny`` (the CPU form of ``bench/gpu_all.sh``'s ``pipeline_stages`` step) times stage 0 and the
last stage and passes its own check. The measured table is in bench/reference/benchmarks_log.md."""

import importlib.util
import json
import math
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _bench():
    spec = importlib.util.spec_from_file_location("bench_pipeline", ROOT / "bench" / "pipeline.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_quick_bubble_table(tmp_path):
    assert _bench().main(["--quick", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "pipeline.json").read_text())
    table = result["table"]
    assert [(r["schedule"], r["pp"], r["microbatches"]) for r in table] == [
        ("GPipe", 2, 4),
        ("1F1B", 2, 4),
        ("Interleaved1F1B", 2, 4),
    ]
    formula = {"GPipe": 1 / 5, "1F1B": 1 / 5, "Interleaved1F1B": 1 / 9}  # (p-1)/(m+p-1), (p-1)/(v·m+p-1)
    for r in table:
        assert math.isclose(r["formula"], formula[r["schedule"]]), r
        assert len(r["idle"]) == len(r["peak_mib"]) == 2, r
        assert all(0.0 <= x <= 1.0 for x in r["idle"]), r
        assert all(math.isfinite(x) and x > 0 for x in r["peak_mib"]) and r["makespan_s"] > 0, r
    ranks = {(r["schedule"], r["rank"]): r["stages"] for r in result["rows"]}
    assert ranks[("1F1B", 0)] == [0] and ranks[("Interleaved1F1B", 1)] == [1, 3], ranks


def _one_rank(out: str) -> int:
    return _bench().main(["--one-rank-stage", "--tiny", "--out", out])


def test_one_rank_stage_tiny(tmp_path):
    from ndparallel.testing import run_on_ranks

    assert run_on_ranks(_one_rank, 1, str(tmp_path)) == [0]  # a child: the engine's one-rank group
    result = json.loads((tmp_path / "pipeline_stages.json").read_text())
    assert [r["stage"] for r in result["rows"]] == [0, 1]
    for r in result["rows"]:
        assert r["forward_ms"] > 0 and r["backward_ms"] > 0 and r["peak_4_mib"] > r["peak_1_mib"] > 0, r
