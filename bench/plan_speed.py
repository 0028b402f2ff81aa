"""How long ``ndparallel plan`` takes: the requests users iterate on, several runs each.

    python bench/plan_speed.py [--runs 3] [--out DIR]

Per request: wall and CPU (user + sys of the child) seconds of each run of the whole command (start,
import, search, table), and the search alone under cProfile (its total, in this process). The CPU
seconds are what a quiet machine would take; the wall seconds depend on the machine's load, printed
beside them (``os.getloadavg``). Then the search's size (options, memory-checked, costed: the
pruning of ``plan/search/bounds.py``) and its CPU seconds, each in a fresh process, against the
same request searched as before issue 61 (``NARROW``: checkpointing full or off, no offloading,
resharding after forward, no tiled MLP): the ratio is measured in one run, on one machine. The
search timed is the table's (``plan(top=TOP)``: the best ``TOP`` layouts ranked, the others only
counted), its size that of every layout's best (``plan()``, as ``--json``). With ``--against SRC``
(another checkout's ``src``, e.g. main's), that tree's search of the same request (the table's,
where it has ``top``), in a fresh process, and the ratio to it. Writes ``plan_speed.json`` into
``--out`` (default bench/results). ``--compare-outputs SRC``: only whether ~30 requests print the
same as with that tree (``plan_outputs.py``: a faster search must answer the same).
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

import plan_outputs

ROOT = Path(__file__).resolve().parents[1]
H100 = "--gpus-per-node 8 --gpu h100-80gb"
REQUESTS = {
    "70B x 64 H100, seq 8192": f"--base-model llama-3.1-70b --gpus 64 {H100} --sequence-len 8192",
    "405B x 8192 H100, seq 8192": (
        f"--base-model llama-3.1-405b --gpus 8192 {H100} --sequence-len 8192 --global-batch-tokens 16777216"
    ),
    "8B x 8 H100": f"--base-model llama-3.1-8b --gpus 8 {H100}",
}


TOP = 10
"""``ndparallel plan``'s default ``--top``: the rows the table's search ranks."""
NARROW = dict(ac_policy="full", activation_offloading=False, reshard_after_forward=True, tiled_mlp=False)
"""The settings the search chose from before issue 61 widened it, pinned: today's search of the old
space."""


def search_size(args: str, narrow: bool) -> dict:
    """CPU seconds of the table's search (``plan(top=TOP)``) in this fresh process, and the size of
    every layout's (``plan()``)."""
    from ndparallel.plan.cli.from_flags import build_request, run_values
    from ndparallel.plan.cli.parser import parse
    from ndparallel.plan.search.evaluation import plan

    parsed = parse(args.split())
    req = build_request(parsed, run_values(parsed))
    req = req.updated(**NARROW) if narrow else req
    t0 = time.process_time()
    top = plan(req, top=TOP)
    cpu = time.process_time() - t0
    result = plan(req)
    assert [r.layout for r in top.ranked] == [r.layout for r in result.ranked[:TOP]]
    layouts = result.ranked + result.rejected
    best = result.ranked[0].best if result.ranked else None
    return {
        "cpu_s": round(cpu, 2),
        "layouts": len(layouts),
        "options": sum(r.searched for r in layouts),
        "memory_checked": sum(r.memory_checked for r in layouts),
        "costed": sum(r.costed for r in layouts),
        "best_mfu": round(best.mfu, 4) if best else None,
    }


def fresh_search(args: str, narrow: bool) -> dict:
    """``search_size`` in a child process (no cache warmed by another search)."""
    code = f"import json, sys; sys.path.insert(0, {str(ROOT / 'bench')!r}); import plan_speed; "
    code += f"print(json.dumps(plan_speed.search_size({args!r}, {narrow})))"
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def against_search(args: str, src: str) -> dict:
    """CPU seconds of the search (``plan.search.plan``; the table's, ``top=TOP``, where the tree has
    it) of another source tree ``src``, in a fresh process, and its best row's MFU (the same answer,
    or the ratio compares two questions)."""
    code = (
        "import inspect, json, time; from ndparallel.plan.cli.from_flags import build_request, run_values; "
        "from ndparallel.plan.cli.parser import parse; from ndparallel.plan.search.evaluation import plan; "
        f"kw = {{'top': {TOP}}} if 'top' in inspect.signature(plan).parameters else {{}}; "
        f"p = parse({args!r}.split()); req = build_request(p, run_values(p)); t0 = time.process_time(); "
        "r = plan(req, **kw); cpu = time.process_time() - t0; "
        "print(json.dumps({'cpu_s': round(cpu, 2), 'best_mfu': round(r.ranked[0].best.mfu, 4)}))"
    )
    env = {**os.environ, "PYTHONPATH": src}
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True, env=env)
    return json.loads(out.stdout.strip().splitlines()[-1])


def run_once(args: str, src: str | None = None) -> tuple[float, float]:
    """(wall, user + sys CPU) seconds of one ``ndparallel plan`` process (``src``: of that tree)."""
    env = {**os.environ, "PYTHONPATH": src} if src else None
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "ndparallel", "plan", *args.split()], check=True, capture_output=True, env=env
    )
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def profiled_search(args: str) -> float:
    """cProfile's total seconds of the table's search (``plan(top=TOP)``) for the request, here."""
    from ndparallel.plan.cli.from_flags import build_request, run_values
    from ndparallel.plan.cli.parser import parse
    from ndparallel.plan.search.evaluation import plan

    parsed = parse(args.split())
    req = build_request(parsed, run_values(parsed))
    prof = cProfile.Profile()
    prof.runcall(plan, req, TOP)
    return pstats.Stats(prof).total_tt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    ap.add_argument("--against", help="another checkout's src directory: its search, same request, same run")
    ap.add_argument("--compare-outputs", metavar="SRC", help="only compare ~30 requests' output with SRC's")
    opts = ap.parse_args()
    if opts.compare_outputs:
        raise SystemExit(plan_outputs.main(["--against", opts.compare_outputs]))
    rows = []
    print(
        "| request | command CPU s | wall s | search, cProfile s | search CPU s (size) | "
        "old space CPU s (size) | ratio | load |"
    )
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
        r["search"], r["search_narrow"] = fresh_search(args, False), fresh_search(args, True)
        r["search_ratio_to_narrow"] = round(r["search"]["cpu_s"] / max(r["search_narrow"]["cpu_s"], 1e-9), 2)
        if opts.against:
            r["against"] = {"src": opts.against, **against_search(args, opts.against)}
            r["search_ratio_to_against"] = round(r["search"]["cpu_s"] / max(r["against"]["cpu_s"], 1e-9), 2)
            r["against"]["command_cpu_s"] = [
                round(run_once(args, opts.against)[1], 2) for _ in range(opts.runs)
            ]
            a = r["against"]
            print(f"  against {opts.against}: command CPU s {a['command_cpu_s']}, search {a['cpu_s']} CPU s")
        w, n = r["search"], r["search_narrow"]
        print(
            f"| {name} | {', '.join(map(str, r['cpu_s']))} | {', '.join(map(str, r['wall_s']))} | "
            f"{r['search_cprofile_s']} | {w['cpu_s']} ({w['options']} options, {w['memory_checked']} "
            f"memory, {w['costed']} costed) | {n['cpu_s']} ({n['options']} options) | "
            f"{r['search_ratio_to_narrow']} | {load:.0f} on {r['cores']} cores |",
            flush=True,
        )
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "plan_speed.json").write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
