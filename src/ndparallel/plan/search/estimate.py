"""One rank's step: memory, collectives and time of a fully specified configuration (no validity
checks), and the ``Estimate`` a layout's option becomes. ``search.estimate`` calls it once without
pipeline parallel, ``pipeline_estimate`` once per pipeline rank it models."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from ndparallel.layout.dims import ParallelDims
from ndparallel.plan import muon_cost
from ndparallel.plan.adapters.lora_cost import adapter_shard_numel
from ndparallel.plan.hardware import GiB, Hardware
from ndparallel.plan.memory.activations import offloaded_layer_bytes
from ndparallel.plan.memory.long_context import offload_exposed_seconds
from ndparallel.plan.memory.peak import MemoryBreakdown, estimate_memory
from ndparallel.plan.models import ModelSpec, fsdp_units
from ndparallel.plan.settings import Settings
from ndparallel.plan.time import comms, links
from ndparallel.plan.time.compute import micro_batch_time, model_flops_per_token, peak, step_extras
from ndparallel.plan.time.membound import unit_param_counts


@dataclass
class TimeBreakdown:
    """Seconds per optimizer step; ``step`` = compute + cp + tp + dp + optimizer + offload + ep
    (+ the pipeline's bubble and exposed transfers)."""

    compute: float
    """ga micro-batches (GEMMs, attention, element-wise, loss, launches) + FSDP's own copies."""
    tp_exposed: float
    cp_exposed: float
    dp_exposed: float
    optimizer: float
    """Optimizer step + gradient clipping (memory-bound)."""
    step: float
    comm_total: dict = field(default_factory=dict)
    """Unhidden time per mesh dim before overlap, and whether its link is intra-node."""
    compute_parts: dict = field(default_factory=dict)
    """One micro-batch by op class (seconds) and the step's memory-bound extras."""
    offload_exposed: float = 0.0
    """Activation-offloading copies not hidden behind compute (in ``step``)."""
    ep_exposed: float = 0.0
    """Expert-parallel all-to-alls (dispatch, combine, split sizes): on the critical path."""
    pp_bubble: float = 0.0
    """Pipeline fill and drain: the slowest rank idle (``plan/pipeline/schedule_model.py``)."""
    pp_exposed: float = 0.0
    """Stage-to-stage transfers on the critical path."""

    @property
    def busy(self) -> float:
        """The rank's work during its micro-batches (what a pipeline's slowest rank paces)."""
        return self.compute + self.tp_exposed + self.cp_exposed + self.offload_exposed + self.ep_exposed


@dataclass
class Estimate:
    layout: ParallelDims
    settings: Settings
    memory: MemoryBreakdown
    time: TimeBreakdown
    global_batch: int
    tokens_per_s_per_gpu: float
    mfu: float
    bottleneck: str
    fits: bool
    collectives: list = field(default_factory=list, repr=False)
    pipeline: object | None = None
    """``pipeline.PipelineInfo`` of a pp layout (schedule, bubble, first/last-stage memory)."""

    def to_dict(self) -> dict:
        out = {
            "layout": asdict(self.layout),
            "settings": asdict(self.settings),
            "global_batch_sequences": self.global_batch,
            "fits": self.fits,
            "memory_gib": {
                k: (v / GiB if isinstance(v, float | int) else v) for k, v in self.memory.to_dict().items()
            },
            "time_s": asdict(self.time),
            "tokens_per_s_per_gpu": self.tokens_per_s_per_gpu,
            "mfu": self.mfu,
            "bottleneck": self.bottleneck,
        }
        if self.pipeline is not None:
            out["pipeline"] = self.pipeline.to_dict()
        return out


def rank_step(
    model: ModelSpec,
    layout: ParallelDims,
    s: Settings,
    hw: Hardware,
    gpus_per_node: int,
    mem: MemoryBreakdown | None = None,
) -> tuple[MemoryBreakdown, list, TimeBreakdown]:
    """Memory, collectives and step time of one rank running ``model`` (under pipeline parallel:
    the rank's share, ``pipeline.rank_model``) for ``s.gradient_accumulation_steps`` micro-batches;
    ``mem``: its ``estimate_memory``, when the caller has it already (the search's memory cut)."""
    mem = mem or estimate_memory(model, layout, s, hw)
    colls = comms.collectives_for(model, layout, s)
    ga = s.gradient_accumulation_steps
    mb_time = micro_batch_time(model, layout, s, hw)
    t_mb, t_attn = mb_time.total, mb_time.attention
    local, shard = unit_param_counts(model, comms.unit_numels(model, layout.tp, layout.fsdp, layout))
    trained = adapter_shard_numel(model, layout, s.lora_r) if s.lora_r else None
    extras = step_extras(model, layout, s, hw, local, shard, trained)
    per_dim: dict[str, float] = {}
    intra: dict[str, bool] = {}
    sums = dict.fromkeys(EXPOSURES, 0.0)
    costs = links.cost_table(layout, hw, gpus_per_node)
    for c in colls:
        sec, is_intra = costs[c]
        per_dim[c.mesh_dim] = per_dim.get(c.mesh_dim, 0.0) + sec
        intra[c.mesh_dim] = is_intra
        sums[exposure(c)] += sec
    gather, reduce, cp, cp_serial, ep, tp = sums.values()
    cp_exposed = (max(0.0, cp / ga - t_attn) + cp_serial / ga) if ga else 0.0
    n_units = sum(count for count, _ in fsdp_units(model).values()) / (
        s.pipeline_virtual_stages if layout.pp > 1 else 1
    )
    dp_exposed = fsdp_exposed(gather, reduce, n_units, s, t_mb)
    t_opt = extras["optimizer"] + extras["clip"]
    if s.optimizer == "muon":  # each hidden matrix gathered whole for Newton-Schulz (plan/muon_cost.py)
        t_opt += muon_cost.gather_seconds(model, layout, hw, gpus_per_node)
    compute = ga * t_mb + extras["fsdp_copies"] + extras.get("nf4_dequant", 0.0)
    layer_bytes = offloaded_layer_bytes(model, layout, s)
    offload = ga * offload_exposed_seconds(model, layout, s, hw.host_link_bw, t_mb, layer_bytes)
    step = compute + ga * cp_exposed + tp + dp_exposed + t_opt + offload + ep
    timeb = TimeBreakdown(
        compute,
        tp,
        ga * cp_exposed,
        dp_exposed,
        t_opt,
        step,
        {d: {"seconds": v, "intra_node": intra[d]} for d, v in per_dim.items()},
        {**mb_time.to_dict(), **extras},
        offload,
        ep,
    )
    return mem, colls, timeb


EXPOSURES = ("gather", "reduce", "cp", "cp_serial", "ep", "tp")
"""How a collective's seconds reach the step (``exposure``)."""


def exposure(c) -> str:
    """Of ``EXPOSURES``: FSDP's all-gathers and gradient reductions (hidden behind compute as far as
    it goes: ``fsdp_exposed``), the CP ring (behind attention), Ulysses' all-to-all (before and
    after attention, not hidden), the experts' all-to-alls (the experts wait for their tokens), and
    the rest, TP's, on the critical path."""
    if c.overlap == "compute":
        return "gather" if c.kind == "all_gather" else "reduce"
    if c.overlap == "attention":
        return "cp"
    if c.mesh_dim == "cp":
        return "cp_serial"
    return "ep" if c.mesh_dim == "ep" else "tp"


def exposed_tp_seconds(
    model: ModelSpec, layout: ParallelDims, s: Settings, hw: Hardware, gpus_per_node: int
) -> float:
    """``rank_step``'s ``tp``: the seconds of the collectives no compute hides (TP's; FSDP's, all
    hidden, are not listed)."""
    costs = links.cost_table(layout, hw, gpus_per_node)
    colls = comms.collectives_for(model, layout, s, with_data_parallel=False)
    return sum(costs[c][0] for c in colls if exposure(c) == "tp")


def fsdp_exposed(gather: float, reduce: float, n_units: float, s: Settings, t_mb: float) -> float:
    """Seconds of FSDP/DP traffic (``gather``, ``reduce``: a step's, before overlap) no compute hides.

    All-gathers (prefetched) hide behind all forward+backward compute, gradient reductions behind
    the backward (2/3 of compute) of the micro-batches that reduce. The first unit's gather and the
    last unit's reduction cannot hide: 2/n_units of the traffic, n_units those of one FSDP root
    (every pipeline stage is one: a rank with v stages has v roots). A pipeline stage root that
    keeps its parameters gathered (``reshard_after_backward`` False) gathers during the first
    micro-batch's forward only (1/3 of one micro-batch to hide behind; with resharding after
    forward, spread over all of them) and reduces after its last backward, when torch's
    ``perform_reduce_grad`` makes the compute stream wait for the reductions: nothing hides them."""
    edge = min(1.0, 2 / n_units)
    if not s.reshard_after_backward:
        window = (s.gradient_accumulation_steps if s.reshard_after_forward else 1 / 3) * t_mb
        return edge * gather + max(0.0, gather * (1 - edge) - window) + reduce
    return (
        edge * (gather + reduce)
        + max(0.0, gather * (1 - edge) - s.gradient_accumulation_steps * t_mb)
        + max(0.0, reduce * (1 - edge) - s.reducing_microbatches * t_mb * 2 / 3)
    )


def finish(
    model: ModelSpec,
    layout: ParallelDims,
    s: Settings,
    hw: Hardware,
    mem: MemoryBreakdown,
    colls: list,
    timeb: TimeBreakdown,
    global_batch: int | None = None,
    pipeline=None,
) -> Estimate:
    """Throughput, MFU (the whole model's FLOPs over every GPU) and the bottleneck of a step."""
    gb = s.micro_batch_size * s.gradient_accumulation_steps * layout.dp
    tokens = gb * s.sequence_len
    world = layout.world
    step = timeb.step
    tps = tokens / step / world
    mfu = (
        tokens
        * model_flops_per_token(model, s.sequence_len, s.lora_r, s.lora_saved)
        / (step * world * peak(hw, s))
    )
    parts = {
        "compute": timeb.compute,
        "tp comm": timeb.tp_exposed,
        "cp comm": timeb.cp_exposed,
        "fsdp/dp comm": timeb.dp_exposed,
        "optimizer step": timeb.optimizer,
        "ep comm": timeb.ep_exposed,
        "pipeline bubble": timeb.pp_bubble,
        "pp comm": timeb.pp_exposed,
    }
    name = top = max(parts, key=parts.get)
    if name.endswith("comm"):
        dims = {
            "tp comm": ["tp"],
            "cp comm": ["cp"],
            "ep comm": ["ep"],
            "pp comm": ["pp"],
            "fsdp/dp comm": ["dp_shard_cp", "dp_replicate", "efsdp"],
        }[name]
        links = {
            ("intra" if timeb.comm_total[d]["intra_node"] else "inter") for d in dims if d in timeb.comm_total
        }
        name += f" ({'/'.join(sorted(links))}-node)"
    bottleneck = f"{name} {parts[top] / step:.0%}"
    return Estimate(
        layout,
        s,
        mem,
        timeb,
        global_batch or gb,
        tps,
        mfu,
        bottleneck,
        mem.total <= hw.mem_bytes,
        colls,
        pipeline,
    )
