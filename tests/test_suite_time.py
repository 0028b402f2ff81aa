"""tests/tools/suite_time.py: the suite's time report reads a JUnit XML as pytest writes it."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _module():
    spec = importlib.util.spec_from_file_location("suite_time", ROOT / "tests" / "tools" / "suite_time.py")
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
        "</testsuite></testsuites>"
    )
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
    assert mod.main([str(report), "--write-durations", str(tmp_path / "d.json")]) == 0
    import json

    assert json.loads((tmp_path / "d.json").read_text()) == {"test_a.py": 25.5, "test_b.py": 4.0}


def test_the_workers_order_is_longest_file_first():
    """conftest orders the files by tests/durations.json, longest first, the tests of a file kept
    together in their own order; a file it does not list counts as a middling one."""
    from conftest import file_weight, order_by_file_weight

    weights = {"test_long.py": 100.0, "test_short.py": 1.0}
    names = ["test_short.py::a", "test_new.py::a", "test_long.py::a", "test_short.py::b", "test_long.py::b"]
    ordered = order_by_file_weight(names, lambda n: n.split("::")[0], weights)
    assert ordered == [
        "test_long.py::a",
        "test_long.py::b",
        "test_new.py::a",
        "test_short.py::a",
        "test_short.py::b",
    ]
    assert file_weight("test_new.py", weights) == file_weight("test_new.py", {})  # unlisted: the default


def test_durations_list_the_suites_files():
    """tests/durations.json names the suite's files (a few new ones may wait for the next refresh:
    they count as middling), and only files that exist."""
    import json

    listed = set(json.loads((ROOT / "tests" / "durations.json").read_text()))
    files = {p.name for p in (ROOT / "tests").glob("test_*.py")}
    assert listed <= files, f"tests/durations.json lists files that are gone: {sorted(listed - files)}"
    assert len(files - listed) <= 5, (
        f"tests/durations.json lacks {sorted(files - listed)}: refresh it "
        "(python tests/tools/suite_time.py REPORT.xml --write-durations)"
    )
