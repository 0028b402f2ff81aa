"""The ``ndparallel simulate`` report as text: the layout, measured vs predicted (memory, compute
time), collectives per mesh dim, and what a fake world cannot show."""

from __future__ import annotations

import io

from rich.console import Console
from rich.table import Table


def _pct(x: float) -> str:
    return f"{x:+.1%}"


def _row(t: Table, label: str, measured: float, p: dict, key: str, err: str | None) -> None:
    if p.get("available") is False:  # no planner model of this layout: the measurement alone
        t.add_row(label, f"{measured:.3f}", "—", "")
        return
    t.add_row(label, f"{measured:.3f}", f"{p[key]:.3f}", _pct(p["error"][err]) if err else "")


def format_report(r: dict) -> str:
    m, p = r["measured"], r["predicted"]
    lay = r["layout"]
    buf = io.StringIO()
    console = Console(file=buf, width=120, force_terminal=False)
    console.print(
        f"simulate: rank {lay['rank']} of {lay['world_size']} ({lay['describe']}) on {lay['device']}; "
        f"model {r['model']['name']} ({r['model']['params'] / 1e6:.1f}M params); "
        f"{r['settings']['steps']} timed steps; planner hardware {p.get('hardware', '—')}"
    )
    console.print(r["settings"]["rows"])
    if "pipeline" in m:
        pl = m["pipeline"]
        layers = sum(len(v) for v in pl["layers"].values())
        console.print(
            f"pipeline: {pl['schedule']}, pp rank {pl['pp_rank']} of {pl['pp']} runs stage(s) "
            f"{pl['stages']} ({layers} layers{', embeddings' if pl['first_stage'] else ''}"
            f"{', norm + head + loss' if pl['last_stage'] else ''}); {pl['microbatches']} micro-batches "
            f"per step, bubble ≈ {pl['bubble']:.0%}; run {pl['run']}"
        )
    t = Table(title="measured vs predicted (this rank)")
    for col in ("", "measured", "predicted", "error"):
        t.add_column(col, justify="right")
    _row(t, "peak memory (GiB)", m["peak_memory_gib"], p, "peak_memory_gib", "peak_memory")
    _row(t, "tensor peak (GiB)", m["tensor_peak_gib"], p, "tensor_peak_gib", "tensor_peak")
    if "offload_host_peak_gib" in m:  # host memory (pinned on a GPU), apart from the device's
        got, want = m["offload_host_peak_gib"], p.get("offload_host_gib")
        t.add_row("offloaded, host (GiB)", f"{got:.3f}", "—" if want is None else f"{want:.3f}", "")
    _row(t, "step compute time (s)", m["step_time_s"], p, "step_time_s", "step_time")
    if "pipeline" in m:
        t.add_row("step + bubble, est. (s)", f"{m['pipeline']['step_time_with_bubble_s']:.3f}", "", "")
    if p.get("available") is not False:
        t.add_row("step time with comm. (s)", "—", f"{p['step_time_with_comm_s']:.3f}", "")
    console.print(t)
    if p.get("available") is False:
        console.print(f"planner: {p['why']}")
    elif "pipeline" in p:
        s = p["pipeline"]
        console.print(
            f"planner: pp rank {s['pp_rank']} as the {s['stage']} stage ({s['layers']} layers, "
            f"{s['in_flight']:g} micro-batches in flight at its peak; no stage transfers counted)"
        )
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
        console.print(
            f"checkpoint: this rank wrote {ck['gib']:.3f} GiB in {ck['seconds']:.2f} s to {ck['path']}"
        )
    if r["fits"] is not None:
        console.print("fits the memory budget" if r["fits"] else "does NOT fit the memory budget")
    console.print(f"note: {r['note']}")
    return buf.getvalue().rstrip()
