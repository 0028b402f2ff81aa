"""Evaluate one layout (memory, step time, throughput) and search all of them."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from ndparallel.plan import comms, muon
from ndparallel.plan.adapter import adapter_shard_numel
from ndparallel.plan.compute import (
    micro_batch_time,
    model_flops_per_token,
    peak,
    step_extras,
)
from ndparallel.plan.hardware import GiB, Hardware
from ndparallel.plan.layout import (
    Layout,
    Settings,
    enumerate_layouts,
    structural_rejections,
)
from ndparallel.plan.long_context import HOST_BUDGET_FRACTION, offload_exposed_seconds
from ndparallel.plan.membound import unit_param_counts
from ndparallel.plan.memory import MemoryBreakdown, estimate_memory
from ndparallel.plan.models import ModelSpec

DEFAULT_GLOBAL_BATCH_TOKENS = 2**22
"""Used when no global batch is given: ~4M tokens, rounded per layout (not enforced exactly)."""
AUTO_MICRO_BATCHES = (1, 2, 4, 8)


@dataclass(frozen=True)
class PlanRequest:
    """What the user asks: model, cluster, hardware and training settings."""

    model: ModelSpec
    hardware: Hardware
    gpus: int
    gpus_per_node: int = 8
    seq_len: int = 4096
    global_batch: int | None = None
    """Sequences per optimizer step; None: about DEFAULT_GLOBAL_BATCH_TOKENS (not enforced)."""
    micro_batch: int | None = None
    """None: try AUTO_MICRO_BATCHES."""
    checkpointing: str = "auto"
    ac_policy: str = "full"
    mixed_precision: str = "bf16"
    optimizer: str = "adamw"
    sequence_parallel: bool = True
    reshard_after_forward: bool = True
    loss_parallel: bool = True
    unsharded_grad_accumulation: bool = False
    cp_strategy: str = "ring"
    cp_kernel: str = "flash"
    loss_impl: str = "chunked"  # what the trainer runs (docs/performance.md)
    loss_chunk_tokens: int | None = None
    optimizer_fused: bool = False
    lora_r: int = 0
    """LoRA rank (``--adapter lora --lora-r``); 0: full fine-tuning."""
    quantized_base: bool = False
    """QLoRA (``--adapter qlora``): a 4-bit NF4 base under the adapters."""
    qat: str | None = None
    """QAT formats (``--qat int4/int8``; ``plan/qat.py``); None: off."""
    lora_saved: tuple[str, ...] = ()
    """Tables trained in full beside the adapters ('embed', 'head': ``--lora-modules-to-save``)."""
    tiled_mlp: bool = False
    tiled_mlp_num_shards: int | None = None
    activation_offloading: bool = False
    """Offload the checkpointed layer inputs (checkpointing is then always on)."""
    host_mem_bytes: float | None = None
    """Host memory per node; with offloading, layouts whose offloaded bytes per node exceed
    ``HOST_BUDGET_FRACTION`` of it are rejected (``host_oom``). None: not checked."""


@dataclass
class TimeBreakdown:
    """Seconds per optimizer step; ``step`` = compute + cp + tp + dp + optimizer + ep."""

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


@dataclass
class Estimate:
    layout: Layout
    settings: Settings
    memory: MemoryBreakdown
    time: TimeBreakdown
    global_batch: int
    tokens_per_s_per_gpu: float
    mfu: float
    bottleneck: str
    fits: bool
    collectives: list = field(default_factory=list, repr=False)

    def to_dict(self) -> dict:
        return {
            "layout": asdict(self.layout), "settings": asdict(self.settings),
            "global_batch_sequences": self.global_batch, "fits": self.fits,
            "memory_gib": {k: (v / GiB if isinstance(v, float | int) else v)
                           for k, v in self.memory.to_dict().items()},
            "time_s": asdict(self.time), "tokens_per_s_per_gpu": self.tokens_per_s_per_gpu,
            "mfu": self.mfu, "bottleneck": self.bottleneck,
        }


@dataclass
class LayoutResult:
    """One layout: its best (micro-batch, checkpointing) option, all options, or why rejected."""

    layout: Layout
    best: Estimate | None = None
    options: list[Estimate] = field(default_factory=list)
    rejections: list[tuple[str, str]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.best is not None

    def to_dict(self) -> dict:
        return {
            "layout": asdict(self.layout), "ok": self.ok,
            "best": self.best.to_dict() if self.best else None,
            "rejections": [{"code": c, "reason": r} for c, r in self.rejections],
        }


@dataclass
class PlanResult:
    request: PlanRequest
    ranked: list[LayoutResult]
    rejected: list[LayoutResult]

    def find(self, layout: Layout) -> LayoutResult | None:
        return next((r for r in self.ranked + self.rejected if r.layout == layout), None)


# --------------------------------------------------------------- evaluation
def estimate(model: ModelSpec, layout: Layout, s: Settings, hw: Hardware, gpus_per_node: int,
             global_batch: int | None = None) -> Estimate:
    """Memory and step time of one fully specified configuration (no validity checks)."""
    mem = estimate_memory(model, layout, s, hw)
    colls = comms.collectives_for(model, layout, s)
    ga = s.grad_accum
    mb_time = micro_batch_time(model, layout, s, hw)
    t_mb, t_attn = mb_time.total, mb_time.attention
    local, shard = unit_param_counts(model, comms.unit_numels(model, layout.tp, layout.fsdp, layout))
    trained = adapter_shard_numel(model, layout, s.lora_r) if s.lora_r else None
    extras = step_extras(model, layout, s, hw, local, shard, trained)
    per_dim: dict[str, float] = {}
    intra: dict[str, bool] = {}
    gather = reduce = tp = cp = cp_serial = ep = 0.0
    for c in colls:
        sec, is_intra = comms.cost(c, layout, hw, gpus_per_node)
        per_dim[c.mesh_dim] = per_dim.get(c.mesh_dim, 0.0) + sec
        intra[c.mesh_dim] = is_intra
        if c.overlap == "compute" and c.kind == "all_gather":
            gather += sec
        elif c.overlap == "compute":
            reduce += sec
        elif c.overlap == "attention":
            cp += sec
        elif c.mesh_dim == "cp":  # CP all-to-all (Ulysses): before/after attention, not hidden
            cp_serial += sec
        elif c.mesh_dim == "ep":  # the experts wait for their tokens: not hidden
            ep += sec
        else:
            tp += sec
    # CP ring hides behind the attention of each step; TP and the CP all-to-all are on the
    # critical path.
    cp_exposed = (max(0.0, cp / ga - t_attn) + cp_serial / ga) if ga else 0.0
    # FSDP/DP: all-gathers (prefetched) hide behind all forward+backward compute, gradient
    # reductions behind the backward (2/3 of compute) of the micro-batches that reduce. The first
    # unit's gather and the last unit's reduction cannot hide: 2/n_units of the traffic.
    n_units = model.layers * (2 if model.is_moe else 1) + (1 if model.tied_embeddings else 2)
    edge = 2 * (gather + reduce) / n_units
    dp_exposed = (edge + max(0.0, gather * (1 - 2 / n_units) - ga * t_mb)
                  + max(0.0, reduce * (1 - 2 / n_units) - s.reducing_microbatches * t_mb * 2 / 3))
    t_opt = extras["optimizer"] + extras["clip"]
    if s.optimizer == "muon":  # each hidden matrix gathered whole for Newton-Schulz (plan/muon.py)
        t_opt += muon.gather_seconds(model, layout, hw, gpus_per_node)
    compute = ga * t_mb + extras["fsdp_copies"] + extras.get("nf4_dequant", 0.0)
    offload = ga * offload_exposed_seconds(model, layout, s, hw.host_link_bw, t_mb)
    step = compute + ga * cp_exposed + tp + dp_exposed + t_opt + offload + ep
    gb = s.micro_batch * ga * layout.dp
    tokens = gb * s.seq_len
    world = layout.world
    tps = tokens / step / world
    mfu = tokens * model_flops_per_token(model, s.seq_len, s.lora_r, s.lora_saved) / (step * world * peak(hw, s))
    parts = {"compute": compute, "tp comm": tp, "cp comm": ga * cp_exposed,
             "fsdp/dp comm": dp_exposed, "optimizer step": t_opt, "ep comm": ep}
    name = max(parts, key=parts.get)
    if name.endswith("comm"):
        dims = {"tp comm": ["tp"], "cp comm": ["cp"], "ep comm": ["ep"],
                "fsdp/dp comm": ["dp_shard_cp", "dp_replicate", "efsdp"]}[name]
        links = {("intra" if intra[d] else "inter") for d in dims if d in intra}
        name += f" ({'/'.join(sorted(links))}-node)"
    bottleneck = f"{name} {parts[max(parts, key=parts.get)] / step:.0%}"
    timeb = TimeBreakdown(compute, tp, ga * cp_exposed, dp_exposed, t_opt, step,
                          {d: {"seconds": v, "intra_node": intra[d]} for d, v in per_dim.items()},
                          {**mb_time.to_dict(), **extras}, offload, ep)
    return Estimate(layout, s, mem, timeb, global_batch or gb, tps, mfu, bottleneck,
                    mem.total <= hw.mem_bytes, colls)


def _grad_accum(req: PlanRequest, layout: Layout, mb: int) -> tuple[int | None, str | None]:
    per_step = layout.dp * mb
    if req.global_batch is None:
        target = max(1, round(DEFAULT_GLOBAL_BATCH_TOKENS / req.seq_len))
        return max(1, round(target / per_step)), None
    if req.global_batch % per_step:
        return None, (f"global batch {req.global_batch} is not divisible by dp × micro_batch = "
                      f"{layout.dp} × {mb} = {per_step}")
    return req.global_batch // per_step, None


def evaluate_layout(req: PlanRequest, layout: Layout, micro_batch: int | None = None,
                    checkpointing: bool | None = None) -> LayoutResult:
    """All (micro-batch, checkpointing) options of one layout; the best that fits is ``best``."""
    res = LayoutResult(layout)
    base = Settings(seq_len=req.seq_len, mixed_precision=req.mixed_precision,
                    optimizer=req.optimizer, sequence_parallel=req.sequence_parallel,
                    reshard_after_forward=req.reshard_after_forward,
                    loss_parallel=req.loss_parallel,
                    unsharded_grad_accumulation=req.unsharded_grad_accumulation,
                    cp_strategy=req.cp_strategy, cp_kernel=req.cp_kernel, ac_policy=req.ac_policy,
                    loss_impl=req.loss_impl, loss_chunk_tokens=req.loss_chunk_tokens,
                    optimizer_fused=req.optimizer_fused, lora_r=req.lora_r, tiled_mlp=req.tiled_mlp,
                    tiled_mlp_num_shards=req.tiled_mlp_num_shards,
                    activation_offloading=req.activation_offloading, quantized_base=req.quantized_base,
                    qat=req.qat, lora_saved=req.lora_saved)
    res.rejections = structural_rejections(layout, req.model, req.gpus, req.gpus_per_node, base)
    if req.quantized_base:
        from ndparallel.plan.qlora import nf4_shards_problem

        why = nf4_shards_problem(req.model, layout)
        res.rejections += [("qlora_layout", why)] if why else []
    if req.lora_saved and layout.tp > 1:  # train refuses it: the copies would not be vocab-sharded
        why = f"lora_modules_to_save with tp={layout.tp}: the trained copies would not be vocab-sharded (train refuses it)"
        res.rejections.append(("lora_layout", why))
    if req.qat and layout.tp > 1:  # parallel/qat.py refuses it: scales computed on TP shards
        why = f"qat with tp={layout.tp}: torchao's fake quantisers would scale TP shards, not whole rows (train refuses it)"
        res.rejections.append(("qat_layout", why))
    if res.rejections:
        return res
    mbs = [micro_batch] if micro_batch else [req.micro_batch] if req.micro_batch else list(
        AUTO_MICRO_BATCHES)
    if checkpointing is not None:
        acs = [checkpointing]
    elif req.activation_offloading:  # offloading moves what checkpointing keeps
        acs = [True]
    else:
        acs = {"auto": [False, True], "on": [True], "off": [False]}[req.checkpointing]
    batch_reasons = []
    for mb in mbs:
        ga, why = _grad_accum(req, layout, mb)
        if ga is None:
            batch_reasons.append(why)
            continue
        for ac in acs:
            s = Settings(**{**asdict(base), "micro_batch": mb, "grad_accum": ga,
                            "checkpointing": ac})
            res.options.append(estimate(req.model, layout, s, req.hardware, req.gpus_per_node))
    host_problem = _check_host(req, layout, res.options)
    fitting = [o for o in res.options if o.fits]
    if fitting:
        res.best = max(fitting, key=lambda o: (o.tokens_per_s_per_gpu, -o.memory.total))
    elif host_problem:
        res.rejections = [("host_oom", host_problem)]
    elif res.options:
        least = min(res.options, key=lambda o: o.memory.total)
        s = least.settings
        res.rejections = [("oom", (
            f"out of memory: needs {least.memory.total / GiB:.1f} GiB > "
            f"{req.hardware.mem_bytes / GiB:.1f} GiB even with micro_batch={s.micro_batch}, "
            f"checkpointing {'on' if s.checkpointing else 'off'}"))]
    else:
        res.rejections = [("global_batch", batch_reasons[0])]
    return res


def _check_host(req: PlanRequest, layout: Layout, options: list[Estimate]) -> str | None:
    """Mark options whose offloaded activations exceed the node's host budget as not fitting;
    the reason when that is what rules out every option that fits the GPU."""
    if req.host_mem_bytes is None:
        return None
    per_node = min(req.gpus_per_node, layout.world)
    budget = HOST_BUDGET_FRACTION * req.host_mem_bytes
    reason = None
    for o in options:
        need = o.memory.host_offload * per_node
        if o.fits and need > budget:
            o.fits = False
            reason = (f"offloaded activations need {need / GiB:.0f} GiB of host memory per node "
                      f"({per_node} GPUs × {o.memory.host_offload / GiB:.1f}) > {HOST_BUDGET_FRACTION:.0%} "
                      f"of --host-mem {req.host_mem_bytes / GiB:.0f} GiB")
    return reason if reason and not any(o.fits for o in options) else None


def plan(req: PlanRequest) -> PlanResult:
    """Evaluate every layout of ``req.gpus`` ranks; rank those that fit by tokens/s per GPU."""
    if req.gpus < 1:
        raise ValueError("--gpus must be >= 1")
    results = [evaluate_layout(req, lay) for lay in enumerate_layouts(req.gpus, req.model.num_experts)]
    ranked = sorted((r for r in results if r.ok),
                    key=lambda r: (-r.best.tokens_per_s_per_gpu, r.best.memory.total))
    rejected = [r for r in results if not r.ok]
    return PlanResult(req, ranked, rejected)
