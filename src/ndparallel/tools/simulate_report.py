"""The ``ndparallel simulate`` report as text: the layout, measured vs predicted (memory, compute
time), collectives per mesh dim, and what a fake world cannot show."""

from __future__ import annotations

import io

from rich.console import Console
from rich.table import Table


def _pct(x: float) -> str:
    return f"{x:+.1%}"


def format_report(r: dict) -> str:
    m, p = r["measured"], r["predicted"]
    lay = r["layout"]
    buf = io.StringIO()
    console = Console(file=buf, width=120, force_terminal=False)
    console.print(f"simulate: rank {lay['rank']} of {lay['world_size']} ({lay['describe']}) on {lay['device']}; "
                  f"model {r['model']['name']} ({r['model']['params'] / 1e6:.1f}M params); "
                  f"{r['settings']['steps']} timed steps; planner hardware {p['hardware']}")
    t = Table(title="measured vs predicted (this rank)")
    for col in ("", "measured", "predicted", "error"):
        t.add_column(col, justify="right")
    t.add_row("peak memory (GiB)", f"{m['peak_memory_gib']:.3f}", f"{p['peak_memory_gib']:.3f}",
              _pct(p["error"]["peak_memory"]))
    t.add_row("tensor peak (GiB)", f"{m['tensor_peak_gib']:.3f}", f"{p['tensor_peak_gib']:.3f}",
              _pct(p["error"]["tensor_peak"]))
    t.add_row("step compute time (s)", f"{m['step_time_s']:.3f}", f"{p['step_time_s']:.3f}",
              _pct(p["error"]["step_time"]))
    t.add_row("step time with comm. (s)", "—", f"{p['step_time_with_comm_s']:.3f}", "")
    console.print(t)
    c = Table(title="collectives per step, by mesh dim (calls / bytes)")
    for col in ("dim", "measured", "predicted"):
        c.add_column(col, justify="right")
    for dim in sorted(set(r["collectives"]) | set(r["predicted_collectives"])):
        got = r["collectives"].get(dim, {"calls": 0, "bytes": 0})
        want = r["predicted_collectives"].get(dim, {"calls": 0, "bytes": 0})
        c.add_row(dim, f"{got['calls']} / {got['bytes']:,}", f"{want['calls']} / {want['bytes']:,}")
    console.print(c)
    if "checkpoint" in m:
        ck = m["checkpoint"]
        console.print(f"checkpoint: this rank wrote {ck['gib']:.3f} GiB in {ck['seconds']:.2f} s to {ck['path']}")
    if r["fits"] is not None:
        console.print("fits the memory budget" if r["fits"] else "does NOT fit the memory budget")
    console.print(f"note: {r['note']}")
    return buf.getvalue().rstrip()
