"""How long ``ndparallel plan`` takes: the requests users iterate on, several runs each.

    python bench/plan_speed.py [--runs 3] [--out DIR]

Per request: wall and CPU (user + sys of the child) seconds of each run of the whole command (start,
import, search, table), and the search alone under cProfile (its total, in this process). The CPU
seconds are what a quiet machine would take; the wall seconds depend on the machine's load, printed
beside them (``os.getloadavg``). Writes ``plan_speed.json`` into ``--out`` (default bench/results).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
H100 = "--gpus-per-node 8 --gpu h100-80gb"
REQUESTS = {
    "70B x 64 H100, seq 8192": f"--base-model llama-3.1-70b --gpus 64 {H100} --sequence-len 8192",
    "405B x 8192 H100, seq 8192": f"--base-model llama-3.1-405b --gpus 8192 {H100} --sequence-len 8192",
    "8B x 8 H100": f"--base-model llama-3.1-8b --gpus 8 {H100}",
}


def run_once(args: str) -> tuple[float, float]:
    """(wall, user + sys CPU) seconds of one ``ndparallel plan`` process."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "ndparallel", "plan", *args.split()], check=True, capture_output=True
    )
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def profiled_search(args: str) -> float:
    """cProfile's total seconds of the search (``plan.search.plan``) for the request, here."""
    from ndparallel.plan.cli.from_flags import build_request, run_values
    from ndparallel.plan.cli.parser import parse
    from ndparallel.plan.search.evaluation import plan

    parsed = parse(args.split())
    req = build_request(parsed, run_values(parsed))
    prof = cProfile.Profile()
    prof.runcall(plan, req)
    return pstats.Stats(prof).total_tt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    opts = ap.parse_args()
    rows = []
    for name, args in REQUESTS.items():
        load = os.getloadavg()[0]
        runs = [run_once(args) for _ in range(opts.runs)]
        rows.append(
            {
                "request": name,
                "args": args,
                "wall_s": [round(w, 2) for w, _ in runs],
                "cpu_s": [round(c, 2) for _, c in runs],
                "search_cprofile_s": round(profiled_search(args), 2),
                "load_avg_1min": load,
                "cores": os.cpu_count(),
            }
        )
        r = rows[-1]
        print(
            f"| {name} | {', '.join(map(str, r['cpu_s']))} | {', '.join(map(str, r['wall_s']))} | "
            f"{r['search_cprofile_s']} | {load:.0f} on {r['cores']} cores |",
            flush=True,
        )
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "plan_speed.json").write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
