"""The correctness gate of ``bench/gpu_single.py`` (the GPU performance rows): a row whose loss drifts
from ``nd eager``'s beyond the stated tolerance fails, and so does a run where the reference itself
did not learn (the comparison would then pass a broken row). The whole script runs, on CPU, as step
``perf_2048`` / ``perf_8192`` of ``bench/gpu_all.sh --cpu-smoke`` (``tests/test_gpu_all.py``).
In-process, nothing written."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import gpu_single  # noqa: E402

REF = [10.0, 9.0, 8.0]


def test_rows_within_the_tolerance_pass():
    rows = {
        "nd eager": {"losses": list(REF)},
        "nd + compile": {"losses": [10.0, 9.05, 8.1]},
        "nd + fp8": {"losses": [10.0, 9.3, 8.3]},
    }  # 3.75 % off: inside fp8's 5 %, not bf16's 2 %
    assert gpu_single.check_drift(rows) == []
    assert rows["nd + compile"]["drift_ok"] and rows["nd + fp8"]["drift_ok"]
    assert abs(rows["nd + fp8"]["drift"] - 0.3 / 8.0) < 1e-12


def test_a_row_that_does_not_learn_fails():
    """Negative control: broken gradients leave the loss flat while the reference falls."""
    rows = {
        "nd eager": {"losses": list(REF)},
        "nd + compile": {"losses": [10.0, 10.0, 10.0]},
        "nd + chunked loss": {"losses": [10.0, 9.0, float("nan")]},
    }
    fails = gpu_single.check_drift(rows)
    assert len(fails) == 2 and not rows["nd + compile"]["drift_ok"], fails
    assert any("nd + chunked loss" in f and "non-finite" in f for f in fails), fails


def test_a_reference_that_does_not_learn_makes_the_check_fail():
    rows = {"nd eager": {"losses": [10.0, 9.95, 9.9]}, "nd + compile": {"losses": [10.0, 9.95, 9.9]}}
    fails = gpu_single.check_drift(rows)
    assert len(fails) == 1 and "cannot tell a broken row" in fails[0], fails


def test_no_reference_no_pass():
    assert gpu_single.check_drift({"accelerate": {"losses": list(REF)}, "nd eager": {"error": "boom"}})


def test_a_row_that_raises_is_recorded_and_the_others_still_run(tmp_path, monkeypatch, capsys):
    """The per-row try/except and the JSON rewritten after every row (no training here: the rows
    are stubbed, so no process group starts in the pytest process)."""
    import json

    monkeypatch.setenv("BENCH_RESULTS_DIR", str(tmp_path))
    falling = {"step_s": 0.1, "times_ms": [100.0], "losses": list(REF), "peak_gib": None}

    def fake_run(name, cfg, device, args, mb):
        if name == "nd + compile":
            raise RuntimeError("inductor exploded")
        return dict(falling)

    monkeypatch.setattr(gpu_single, "run_variant", fake_run)
    assert gpu_single.main(["--tiny", "--name", "t"]) == 1
    rows = json.loads((tmp_path / "t.json").read_text())["results"]["32"]
    assert list(rows) == list(gpu_single.VARIANTS)
    assert rows["nd + compile"] == {"error": "RuntimeError: inductor exploded"}
    assert all(rows[v]["drift_ok"] for v in gpu_single.VARIANTS if v != "nd + compile")
    out = capsys.readouterr().out
    assert "FAIL seq 32: nd + compile: RuntimeError: inductor exploded" in out and "HEADLINE: " in out
