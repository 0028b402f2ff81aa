"""bench/test_time.py: the suite's time report reads a JUnit XML as pytest writes it."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _module():
    spec = importlib.util.spec_from_file_location("test_time", ROOT / "bench" / "test_time.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_report_ranks_tests_files_and_lengths(tmp_path, capsys):
    report = tmp_path / "r.xml"
    report.write_text(
        '<?xml version="1.0"?><testsuites><testsuite name="pytest">'
        '<testcase classname="tests.test_a" name="test_slow" time="25.0"/>'
        '<testcase classname="tests.test_a" name="test_fast" time="0.5"/>'
        '<testcase classname="tests.test_b" name="test_mid[x]" time="4.0"><failure message="m"/></testcase>'
        '<testcase classname="tests.test_b" name="test_skip" time="0.0"><skipped message="s"/></testcase>'
        "</testsuite></testsuites>")
    mod = _module()
    summary = mod.summarise(mod.read_report(report), top=2)
    assert summary["tests"] == 4 and summary["total_s"] == 29.5
    assert summary["outcomes"] == {"passed": 2, "failure": 1, "skipped": 1}
    assert [r["test"] for r in summary["slowest"]] == ["test_a::test_slow", "test_b::test_mid[x]"]
    assert list(summary["files"]) == ["test_a", "test_b"] and summary["files"]["test_b"]["tests"] == 2
    assert summary["by_length"][">= 20 s"] == {"tests": 1, "s": 25.0}
    assert summary["by_length"]["3-10 s"] == {"tests": 1, "s": 4.0}
    assert summary["by_length"]["< 1 s"] == {"tests": 2, "s": 0.5}
    assert mod.main([str(report), "--json", str(tmp_path / "s.json")]) == 0
    assert "test_a::test_slow" in capsys.readouterr().out and (tmp_path / "s.json").is_file()
