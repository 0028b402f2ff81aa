"""The links under the collectives: which mesh dims stay inside a node, the alpha-beta time of
one call (``collective_time``) and the seconds of a step's calls (``cost``, from one table per
layout: ``cost_table``). ``plan/time/comms.py`` lists the collectives."""

from __future__ import annotations

from functools import lru_cache

from ndparallel.layout.dims import ParallelDims
from ndparallel.plan.hardware import Hardware


@lru_cache(maxsize=8192)
def group_is_intra_node(layout: ParallelDims, dim: str, gpus_per_node: int) -> bool:
    """Do all groups along ``dim`` stay inside one node? Ranks are laid out mesh order
    (dp_replicate, dp_shard, cp, tp), node k holding ranks [k·G, (k+1)·G): a group of size n with
    stride I occupies aligned blocks of n·I consecutive ranks, inside a node iff n·I divides G."""
    n = layout.size(dim)
    if n == 1 or layout.world <= gpus_per_node:
        return True
    return gpus_per_node % (n * layout.inner_size(dim)) == 0


def _measured(hw: Hardware, kind: str, n: int) -> dict | None:
    table = hw.collectives.get(kind) or hw.collectives.get("all_reduce")
    if not table:
        return None
    sizes = sorted(int(k) for k in table)
    best = min(sizes, key=lambda k: (abs(k - n), -k))
    return table[str(best)]


def collective_time(kind: str, nbytes: float, n: int, hw: Hardware, intra: bool) -> float:
    """Alpha-beta ring time of one call (NCCL ring algorithm):
    all-gather (n−1)(α + b/B) with b the input shard; reduce-scatter (n−1)(α + b/(nB));
    all-reduce 2(n−1)(α + b/(nB)); send/recv α + b/B; all-to-all (n−1)(α + b/(nB))."""
    if n <= 1:
        return 0.0
    m = _measured(hw, kind, n) if intra else None
    if m is not None:
        alpha, bw = m["alpha_s"], m["bus_bw"]
    elif intra:
        alpha, bw = hw.intra_node_latency, hw.intra_node_bw * hw.link_efficiency
    else:
        alpha, bw = hw.inter_node_latency, hw.inter_node_bw * hw.link_efficiency
    if kind == "all_gather":
        return (n - 1) * (alpha + nbytes / bw)
    if kind == "reduce_scatter":
        return (n - 1) * (alpha + nbytes / (n * bw))
    if kind == "all_reduce":
        return 2 * (n - 1) * (alpha + nbytes / (n * bw))
    if kind == "send_recv":
        return alpha + nbytes / bw
    if kind == "all_to_all":  # pairwise exchange: (n−1)/n of the input leaves each rank
        return (n - 1) * (alpha + nbytes / (n * bw))
    raise ValueError(f"unknown collective kind {kind!r}")


def cost(c, layout: ParallelDims, hw: Hardware, gpus_per_node: int) -> tuple[float, bool]:
    """(seconds per step for all ``c.count`` calls of the ``comms.Collective`` ``c``, intra-node
    link?): ``cost_table``'s entry."""
    return cost_table(layout, hw, gpus_per_node)[c]


def cost_table(layout: ParallelDims, hw: Hardware, gpus_per_node: int) -> dict:
    """``cost`` of collectives on ``layout``, looked up as ``table[c]`` and computed on a miss: one
    table per layout and hardware profile (by identity: a calibrated one's measured collectives
    are not compared), so that a step's ~15 lookups hash only the collective. The search asks
    for the same collectives under every option of a layout."""
    return _cost_table(layout, hw, id(hw), gpus_per_node)


class _CostTable(dict):
    def __init__(self, layout: ParallelDims, hw: Hardware, gpus_per_node: int) -> None:
        super().__init__()
        self.layout, self.hw, self.gpus_per_node = layout, hw, gpus_per_node
        self.links: dict[str, tuple[int, bool]] = {}
        """Mesh dim -> (group size, intra-node?)."""

    def __missing__(self, c) -> tuple[float, bool]:
        link = self.links.get(c.mesh_dim)
        if link is None:
            dim = c.mesh_dim
            link = self.links[dim] = (
                self.layout.size(dim),
                group_is_intra_node(self.layout, dim, self.gpus_per_node),
            )
        n, intra = link
        if c.kind == "send_recv":
            n = max(n, 2)
        value = self[c] = (c.count * collective_time(c.kind, c.bytes, n, self.hw, intra), intra)
        return value


@lru_cache(maxsize=256)
def _cost_table(layout: ParallelDims, hw: Hardware, _hw: int, gpus_per_node: int) -> _CostTable:
    return _CostTable(layout, hw, gpus_per_node)
