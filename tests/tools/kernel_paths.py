"""The equivalence-heavy test files under every CPU kernel path this machine offers (issue 47).

    python tests/tools/kernel_paths.py [--files tests/test_a.py ...] [--paths default MKL_CBWR=AVX2 ...]
    python tests/tools/kernel_paths.py --whole-suite --paths MKL_CBWR=AVX512   # scripts/test.sh under a path

MKL picks its code path by CPU (``MKL_CBWR`` unset): AVX-512 on an Intel Xeon, AVX2 on an AMD EPYC;
``MKL_CBWR=AVX2|COMPATIBLE|AVX512`` forces one. ATen's own vectorised kernels take
``ATEN_CPU_CAPABILITY=default|avx2|avx512``. Each path rounds differently; "equal to one process"
(``tools.agreement``) must hold on all of them with headroom. Per path and file: passed / failed, the
largest ratio of a measured difference to its bound over the files' equal-to-one-process checks
(≤ 0.5: headroom), and the smallest ratio of a fault injection (≫ 1: the faults still fail by
orders of magnitude). Each comparison's ratios come from ``NDPARALLEL_EQUIVALENCE_RATIOS``.
Writes ``bench/results/kernel_paths.json``; the dated tables are in bench/reference/equivalence_headroom.md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
from _common import results_dir, write_json  # noqa: E402  (the benchmarks' JSON helpers)

FILES = [
    "tests/test_multimodal.py",
    "tests/test_packed_documents.py",
    "tests/test_pipeline_equivalence.py",
    "tests/test_rounding_bounds.py",
    "tests/test_fsdp_equivalence.py",
    "tests/test_moe_equivalence.py",
    "tests/test_qat.py",
    "tests/test_fp16.py",
    "tests/test_optim_muon.py",
    "tests/test_float8.py",
    "tests/test_tensor_parallel.py",
]


def available_paths() -> list[str]:
    """The kernel paths this CPU can run (AVX-512 ones only where the CPU has AVX-512)."""
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    paths = ["default", "MKL_CBWR=AVX2", "MKL_CBWR=COMPATIBLE"]
    if "avx512f" in flags:
        paths.append("MKL_CBWR=AVX512")
    return paths + ["ATEN_CPU_CAPABILITY=default", "ATEN_CPU_CAPABILITY=avx2"]


FINGERPRINT = """
import hashlib, numpy, torch
torch.set_num_threads(1)
rng, h = numpy.random.default_rng(0), hashlib.sha1()
for n in (17, 64, 129, 300, 513):  # inputs from numpy: only the GEMM runs in torch
    shapes = ((n, n + 3), (n + 3, n - 1))
    a, b = (torch.from_numpy(rng.standard_normal(s, dtype=numpy.float32)) for s in shapes)
    h.update((a @ b).numpy().tobytes())
print(h.hexdigest()[:12])
"""


def _env(path: str) -> dict[str, str]:
    env = dict(os.environ)
    if path != "default":
        key, value = path.split("=", 1)
        env[key] = value
    return env


def gemm_fingerprint(path: str) -> str:
    """A hash of a few fp32 GEMMs' bits under ``path``: two paths with one fingerprint run the
    same BLAS kernels (on an AMD EPYC, MKL's ``AVX512`` and ``AVX2`` are its default path)."""
    out = subprocess.run([sys.executable, "-c", FINGERPRINT], env=_env(path), capture_output=True, text=True)
    return out.stdout.strip() or "?"


def run_path(path: str, files: list[str]) -> list[dict]:
    """The files under one path in one pytest run: per file its outcome and the recorded ratios."""
    with tempfile.TemporaryDirectory() as tmp:
        ratios_file, report = Path(tmp) / "ratios.jsonl", Path(tmp) / "report.xml"
        env = {**_env(path), "NDPARALLEL_EQUIVALENCE_RATIOS": str(ratios_file)}
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={report}", *files]
        subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        text = ratios_file.read_text() if ratios_file.exists() else ""
        lines = [json.loads(line) for line in text.splitlines() if line]
        cases = ET.parse(report).getroot().iter("testcase") if report.exists() else []
        outcomes = [(c.get("classname", "").replace(".", "/") + ".py", _outcome(c)) for c in cases]
    return [_row(path, file, lines, outcomes) for file in files]


def run_suite(path: str) -> dict:
    """The whole suite (``scripts/test.sh``, its workers and lint included) under one path: the
    totals, its minutes, and the file with the largest ratio and the one with the weakest fault."""
    with tempfile.TemporaryDirectory() as tmp:
        ratios_file, report = Path(tmp) / "ratios.jsonl", Path(tmp) / "report.xml"
        env = {**_env(path), "NDPARALLEL_EQUIVALENCE_RATIOS": str(ratios_file)}
        cmd = ["bash", "scripts/test.sh", "-p", "no:cacheprovider", f"--junitxml={report}"]
        start = time.monotonic()
        done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        minutes = (time.monotonic() - start) / 60
        log = results_dir() / f"kernel_paths_suite_{path.replace('=', '_')}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text(done.stdout + done.stderr)  # the failures' tracebacks, for the table's reader
        return summarise_suite(path, ratios_file, report, minutes, done.returncode)


def summarise_suite(path: str, ratios_file: Path, report: Path, minutes: float, returncode: int) -> dict:
    """One path's row from a whole-suite run's ratio lines and JUnit report (also for a run made by
    hand: ``NDPARALLEL_EQUIVALENCE_RATIOS=F bash scripts/test.sh --junitxml=R``)."""
    text = ratios_file.read_text() if ratios_file.exists() else ""
    lines = [json.loads(line) for line in text.splitlines() if line]
    cases = list(ET.parse(report).getroot().iter("testcase")) if report.exists() else []
    outcomes = [(c.get("classname", "").replace(".", "/") + ".py", _outcome(c)) for c in cases]
    rows = [_row(path, f, lines, outcomes) for f in sorted({f for f, _ in outcomes})]
    equal = [r for r in rows if r["largest_ratio"] is not None]
    faults = [r for r in rows if r["smallest_fault_ratio"] is not None]
    worst = max(equal, key=lambda r: r["largest_ratio"], default=None)
    weakest = min(faults, key=lambda r: r["smallest_fault_ratio"], default=None)
    return {
        "path": path,
        "ok": returncode == 0 and all(r["ok"] for r in rows),
        "passed": sum(o == "passed" for _, o in outcomes),
        "failed": sum(o == "failed" for _, o in outcomes),
        "failed_files": [r["file"] for r in rows if not r["ok"]],
        "checks": sum(r["checks"] for r in rows),
        "minutes": round(minutes, 1),
        "largest_ratio": worst and (worst["largest_ratio"], worst["file"]),
        "smallest_fault_ratio": weakest and (weakest["smallest_fault_ratio"], weakest["file"]),
    }


def suite_markdown(rows: list[dict]) -> str:
    out = [
        "| path | result | checks | largest diff / bound | weakest fault / bound | minutes |",
        "|---" * 6 + "|",
    ]
    for r in rows:
        result = f"{r['passed']} passed" + (
            f", {r['failed']} failed ({', '.join(r['failed_files'])})" if r["failed"] else ""
        )
        big, weak = (_where(r["largest_ratio"]), _where(r["smallest_fault_ratio"]))
        out.append(f"| {r['path']} | {result} | {r['checks']} | {big} | {weak} | {r['minutes']} |")
    return "\n".join(out)


def _where(ratio_file: tuple[float, str] | None) -> str:
    return "—" if not ratio_file else f"{_fmt(ratio_file[0])} ({Path(ratio_file[1]).name})"


def _outcome(case) -> str:
    if case.find("failure") is not None or case.find("error") is not None:
        return "failed"
    return "skipped" if case.find("skipped") is not None else "passed"


def _row(path: str, file: str, lines: list[dict], outcomes: list[tuple[str, str]]) -> dict:
    mine = [x for x in lines if x["test"].startswith(file)]
    results = [o for f, o in outcomes if f == file]
    # a decision (expect_equal None: the pre-launch family check) counts as its outcome says
    equal = [_largest(x) for x in mine if x["expect_equal"] or (x["expect_equal"] is None and x["ok"])]
    faults = [
        _largest(x) for x in mine if x["expect_equal"] is False or (x["expect_equal"] is None and not x["ok"])
    ]
    return {
        "path": path,
        "file": file,
        "ok": bool(results) and "failed" not in results,
        "summary": ", ".join(
            f"{results.count(o)} {o}" for o in ("passed", "failed", "skipped") if o in results
        ),
        "checks": len(equal),
        "largest_ratio": max(equal, default=None),
        "smallest_fault_ratio": min(faults, default=None),
    }


def _largest(line: dict) -> float:
    return max(line["ratios"].values(), default=0.0)


def _fmt(x: float | None) -> str:
    return "—" if x is None else f"{x:.2g}"


def markdown(rows: list[dict]) -> str:
    out = [
        "| path | file | result | checks | largest diff / bound | smallest fault / bound |",
        "|---" * 6 + "|",
    ]
    for r in rows:
        result = r["summary"] or ("passed" if r["ok"] else "FAILED")
        out.append(
            f"| {r['path']} | {Path(r['file']).name} | {result} | "
            f"{r['checks']} | {_fmt(r['largest_ratio'])} | {_fmt(r['smallest_fault_ratio'])} |"
        )
    return "\n".join(out)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--files", nargs="+", default=FILES)
    parser.add_argument("--paths", nargs="+", default=None, help="default: every path the CPU offers")
    parser.add_argument("--fingerprints", action="store_true", help="only each path's GEMM fingerprint")
    parser.add_argument("--whole-suite", action="store_true", help="scripts/test.sh under each path")
    args = parser.parse_args()
    paths = args.paths or available_paths()
    if args.whole_suite:
        suites = []
        for path in paths:
            suites.append(run_suite(path))
            print(suite_markdown(suites[-1:]).splitlines()[-1], flush=True)
        print(suite_markdown(suites))
        write_json("kernel_paths_suite", {"rows": suites})
        return 0 if all(r["ok"] and (r["largest_ratio"] or (0,))[0] <= 0.5 for r in suites) else 1
    for path in paths:  # which paths are really different kernels on this CPU
        print(f"{path}: GEMM fingerprint {gemm_fingerprint(path)}", flush=True)
    if args.fingerprints:
        return 0
    rows = []
    for path in paths:
        rows += run_path(path, args.files)
        print("\n".join(markdown(rows[-len(args.files) :]).splitlines()[2:]), flush=True)
    print(markdown(rows))
    write_json("kernel_paths", {"rows": rows})
    worst = max((r["largest_ratio"] or 0.0 for r in rows), default=0.0)
    return 0 if all(r["ok"] for r in rows) and worst <= 0.5 else 1


if __name__ == "__main__":
    sys.exit(main())
