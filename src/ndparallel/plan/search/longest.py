"""``ndparallel plan --max-seq-len``: the longest sequence a model trains with on N GPUs.

For every layout, the longest sequence length whose best option (micro-batch 1, one sequence per
data-parallel rank and step, checkpointing as requested) fits in GPU memory — and, with
``--host-mem``, whose offloaded activations fit the node's host memory. Memory grows with the
sequence, so each layout is searched by doubling then bisection, over multiples of ``2·cp·tp``
(the load-balanced CP chunks, split again over tp by sequence parallel), to within
``TOLERANCE``. A layout with context parallelism is searched with each CP strategy in
``strategies`` (every one unless ``--cp-strategy`` pins it) and keeps the longest. The summary
compares the long-context options: none, tiled MLP, offloading, both.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from rich.console import Console
from rich.table import Table

from ndparallel.layout.dims import ParallelDims
from ndparallel.plan.hardware import GiB
from ndparallel.plan.search.estimate import Estimate
from ndparallel.plan.search.evaluation import evaluate_layout
from ndparallel.plan.search.layouts import enumerate_layouts
from ndparallel.plan.search.request import PlanRequest

SEARCH_CAP = 2**27
"""Longest sequence tried: 134M tokens."""
START = 4096
TOLERANCE = 0.005
"""Bisection stops when the bracket is within this fraction of the answer."""
RESOURCE_CODES = ("oom", "host_oom")


@dataclass
class Longest:
    layout: ParallelDims
    sequence_len: int = 0
    """0: not even the shortest sequence fits (or the layout cannot run: ``reason``)."""
    best: Estimate | None = None
    reason: str | None = None

    def to_dict(self) -> dict:
        out = {
            "layout": dataclasses.asdict(self.layout),
            "max_seq_len": self.sequence_len,
            "reason": self.reason,
        }
        if self.best is not None:
            out["at_max"] = self.best.to_dict()
        return out


def _quantum(layout: ParallelDims) -> int:
    return 2 * layout.cp * layout.tp


def _try(req: PlanRequest, layout: ParallelDims, seq: int):
    """(best estimate or None, rejection code or None) at ``seq`` tokens, micro-batch 1."""
    r = req.updated(sequence_len=seq, micro_batch_size=1, global_batch_size=layout.dp)
    res = evaluate_layout(r, layout, skip_unfit=True)  # the best only: pruned (search/bounds.py)
    return res.best, (res.rejections[0] if res.rejections else None)


def longest_for_layout(req: PlanRequest, layout: ParallelDims, cap: int = SEARCH_CAP) -> Longest:
    q = _quantum(layout)
    lo = max(1, START // q)
    best, why = _try(req, layout, lo * q)
    if best is None:
        if why and why[0] not in RESOURCE_CODES:
            return Longest(layout, reason=f"[{why[0]}] {why[1]}")
        lo_best, hi = None, lo
        lo = 0
    else:
        lo_best, hi = best, lo
        while best is not None and hi * 2 * q <= cap:
            lo, lo_best = hi, best
            hi *= 2
            best, why = _try(req, layout, hi * q)
        if best is not None:  # fits at the cap
            return Longest(layout, hi * q, best, f"fits at the search cap ({cap:,} tokens)")
    while hi - lo > max(1, int(lo * TOLERANCE)):
        mid = (lo + hi) // 2
        best, _ = _try(req, layout, mid * q)
        if best is not None:
            lo, lo_best = mid, best
        else:
            hi = mid
    if lo == 0:
        return Longest(layout, reason=f"out of memory even at {q:,} tokens")
    return Longest(layout, lo * q, lo_best)


CP_STRATEGIES = ("ring", "allgather", "ulysses")


def _rank(r: Longest) -> tuple:
    return (-r.sequence_len, -(r.best.tokens_per_s_per_gpu if r.best else 0))


def longest_any_strategy(
    req: PlanRequest, layout: ParallelDims, strategies, cap: int = SEARCH_CAP
) -> Longest:
    """``longest_for_layout`` with the CP strategy of ``strategies`` that trains the longest (the
    request's own without CP, where none applies)."""
    if layout.cp == 1 or not strategies:
        return longest_for_layout(req, layout, cap)
    rows = [longest_for_layout(req.updated(cp_comm_strategy=name), layout, cap) for name in strategies]
    return min(rows, key=_rank)


def longest(req: PlanRequest, cap: int = SEARCH_CAP, strategies=()) -> list[Longest]:
    """Every layout of ``req.gpus`` ranks, the longest first (ties: tokens/s per GPU); with
    ``strategies``, each CP layout under the one of them that trains the longest."""
    rows = [longest_any_strategy(req, lay, strategies, cap) for lay in enumerate_layouts(req.gpus)]
    return sorted(rows, key=_rank)


FEATURES = {
    "plain": (False, False),
    "tiled MLP": (True, False),
    "offloading": (False, True),
    "tiled MLP + offloading": (True, True),
}


def feature_summary(req: PlanRequest, cap: int = SEARCH_CAP, strategies=()) -> dict[str, Longest | None]:
    """The longest layout with each combination of the long-context options."""
    out = {}
    for name, (tiled, offload) in FEATURES.items():
        r = req.updated(
            tiled_mlp=tiled,
            activation_offloading=offload,
            activation_checkpointing="on" if offload else req.activation_checkpointing,
        )
        rows = [x for x in longest(r, cap, strategies) if x.sequence_len]
        out[name] = rows[0] if rows else None
    return out


def _row_cells(r: Longest, per_node: int) -> list[str]:
    e = r.best
    s = e.settings
    host = (
        f"{e.memory.host_offload * min(per_node, r.layout.world) / GiB:.0f}"
        if s.activation_offloading
        else "-"
    )
    strategy = r.layout.describe() + (f" ({s.cp_comm_strategy})" if r.layout.cp > 1 else "")
    return [
        r.layout.compact(),
        strategy,
        f"{r.sequence_len:,}",
        "on" if s.activation_checkpointing else "off",
        f"{e.memory.total / GiB:.1f}",
        host,
        f"{e.tokens_per_s_per_gpu:,.0f}",
        f"{e.mfu:.1%}",
    ]


def _switch(value: bool | None) -> str:
    """A searched switch of the request: auto (the search chooses), on or off."""
    return "auto" if value is None else "on" if value else "off"


def print_longest(
    req: PlanRequest, rows: list[Longest], summary: dict | None, console: Console, top: int = 10
) -> None:
    console.print(
        f"{req.model.name} on {req.gpus} × {req.hardware.name} ({req.hardware.mem_bytes / GiB:.0f} "
        f"GiB): longest sequence per layout, micro-batch 1, one sequence per dp rank; tiled MLP "
        f"{_switch(req.tiled_mlp)}, activation offloading {_switch(req.activation_offloading)}"
        + ("" if req.host_mem_bytes else " (host memory not checked: --host-mem)")
    )
    cols = ("layout", "strategy", "max seq", "AC", "mem GiB", "host GiB/node", "tok/s/GPU", "MFU")
    if summary:
        t = Table(title="Long-context options (best layout each)")
        for c in ("options", *cols):
            t.add_column(c)
        for name, r in summary.items():
            t.add_row(name, *(_row_cells(r, req.gpus_per_node) if r else ["-"] * len(cols)))
        console.print(t)
    t = Table(title=f"Layouts, longest first ({sum(1 for r in rows if r.sequence_len)} train at all)")
    for c in cols:
        t.add_column(c)
    for r in [r for r in rows if r.sequence_len][:top]:
        t.add_row(*_row_cells(r, req.gpus_per_node))
    console.print(t)
    console.print(
        "Memory only bounds these lengths: the step time grows with s² (attention); "
        "a model beyond its max_position_embeddings needs RoPE scaling."
    )
