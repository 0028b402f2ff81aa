"""Where the test suite's time goes, from a pytest JUnit XML report (issue 35).

    python tests/tools/suite_time.py REPORT.xml [--top 30] [--json OUT.json]
    python tests/tools/suite_time.py --run [--top 30] [--json OUT.json]   # runs scripts/test.sh first
    python tests/tools/suite_time.py REPORT.xml --write-durations      # refresh tests/durations.json

`tests/durations.json` (seconds per test file, from a serial run's report) orders the files for the
test workers, longest first (`tests/conftest.py`); a stale entry changes the order, nothing else.

Prints the slowest tests, the time per test file, and how the total splits by test length (the few
long tests — real launches of `ndparallel train`, gpu_all's CPU smoke — against the many short ones).
The budget (docs/testing.md) lives here, never in a timed test: these machines are noisy, so compare
runs made on the same machine.
"""

from __future__ import annotations

import argparse
import collections
import json
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DURATIONS = ROOT / "tests" / "durations.json"
BUCKETS = ((20.0, ">= 20 s"), (10.0, "10-20 s"), (3.0, "3-10 s"), (1.0, "1-3 s"), (0.0, "< 1 s"))


def read_report(path: Path) -> list[tuple[str, str, float, str, float | None]]:
    """(file, test, seconds, outcome, CPU seconds or None) of every test case in a JUnit XML report
    (the CPU seconds: the ``cpu_s`` property tests/conftest.py records)."""
    cases = []
    for case in ET.parse(path).iter("testcase"):
        module = case.get("classname", "").split(".")
        file = next((part for part in module if part.startswith("test_")), module[-1])
        outcome = next(
            (child.tag for child in case if child.tag in ("failure", "error", "skipped")), "passed"
        )
        cpu = next((float(p.get("value")) for p in case.iter("property") if p.get("name") == "cpu_s"), None)
        cases.append((file, case.get("name", "?"), float(case.get("time", 0.0)), outcome, cpu))
    return cases


def summarise(cases, top: int) -> dict:
    by_file = collections.defaultdict(lambda: [0, 0.0, 0.0])
    by_bucket = collections.defaultdict(lambda: [0, 0.0])
    for file, _, seconds, _, cpu in cases:
        by_file[file][0] += 1
        by_file[file][1] += seconds
        by_file[file][2] += cpu or 0.0
        label = next(label for floor, label in BUCKETS if seconds >= floor)
        by_bucket[label][0] += 1
        by_bucket[label][1] += seconds
    outcomes = collections.Counter(c[3] for c in cases)
    has_cpu = any(c[4] is not None for c in cases)
    return {
        "tests": len(cases),
        "outcomes": dict(outcomes),
        "total_s": round(sum(c[2] for c in cases), 1),
        "cpu_s": round(sum(c[4] or 0.0 for c in cases), 1) if has_cpu else None,
        "slowest": [
            {"test": f"{f}::{n}", "s": round(s, 1)}
            for f, n, s, *_ in sorted(cases, key=lambda c: -c[2])[:top]
        ],
        "most_cpu": [
            {"test": f"{f}::{n}", "cpu_s": round(cpu, 1)}
            for f, n, _, _, cpu in sorted(cases, key=lambda c: -(c[4] or 0.0))[:top]
        ]
        if has_cpu
        else [],
        "files": {
            f: {"tests": n, "s": round(s, 1), "cpu_s": round(cpu, 1)}
            for f, (n, s, cpu) in sorted(by_file.items(), key=lambda x: -x[1][1])
        },
        "by_length": {
            label: {"tests": by_bucket[label][0], "s": round(by_bucket[label][1], 1)} for _, label in BUCKETS
        },
    }


def print_summary(summary: dict, top_files: int = 20) -> None:
    total = summary["total_s"] or 1.0
    cpu = f", {summary['cpu_s']:.0f} CPU s" if summary.get("cpu_s") is not None else ""
    print(
        f"{summary['tests']} tests, {summary['total_s']:.0f} s in test bodies and fixtures{cpu}; "
        f"{summary['outcomes']}"
    )
    print(f"\n{len(summary['slowest'])} slowest tests:")
    for row in summary["slowest"]:
        print(f"  {row['s']:7.1f} s  {row['test']}")
    if summary.get("most_cpu"):
        print(
            f"\n{len(summary['most_cpu'])} tests using the most CPU (the ranks and commands they ran "
            f"included):"
        )
        for row in summary["most_cpu"]:
            print(f"  {row['cpu_s']:7.1f} CPU s  {row['test']}")
    print(f"\n{top_files} slowest files:")
    for file, row in list(summary["files"].items())[:top_files]:
        print(f"  {row['s']:7.1f} s  {row['cpu_s']:7.1f} CPU s  {row['tests']:4d} tests  {file}")
    print("\nby test length:")
    for label, row in summary["by_length"].items():
        print(f"  {label:8}  {row['tests']:5d} tests  {row['s']:7.1f} s  ({100 * row['s'] / total:4.1f}%)")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("report", nargs="?", type=Path, help="a pytest --junitxml report")
    parser.add_argument("--run", action="store_true", help="run scripts/test.sh first and read its report")
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--json", type=Path, help="also write the summary as JSON here")
    parser.add_argument(
        "--write-durations",
        nargs="?",
        type=Path,
        const=DURATIONS,
        metavar="PATH",
        help="write seconds per test file (the workers' order) to PATH "
        f"(default {DURATIONS.relative_to(ROOT)})",
    )
    args = parser.parse_args(argv)
    if args.run == (args.report is not None):
        parser.error("give a REPORT.xml or --run (one of them)")
    report = args.report
    if args.run:
        report = Path(tempfile.mkdtemp(prefix="ndparallel-test-time-")) / "report.xml"
        subprocess.run(["bash", str(ROOT / "scripts" / "test.sh"), f"--junitxml={report}"], cwd=ROOT)
    if not report.is_file():
        parser.error(f"no report at {report}: run `bash scripts/test.sh --junitxml={report}` first")
    summary = summarise(read_report(report), args.top)
    print_summary(summary)
    if args.json:
        args.json.write_text(json.dumps(summary, indent=1))
    if args.write_durations:
        write_durations(summary, args.write_durations)
    return 0


def write_durations(summary: dict, path: Path) -> None:
    """Seconds per test file (``test_x.py``), longest first, as ``tests/conftest.py`` reads them."""
    files = {f"{name}.py": row["s"] for name, row in summary["files"].items()}
    path.write_text(json.dumps(files, indent=0) + "\n")
    print(f"\nwrote {len(files)} files' durations to {path}")


if __name__ == "__main__":
    sys.exit(main())
