"""Evaluate one layout (memory, step time, throughput) and search all of them."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields, replace

from ndparallel.layout.dims import ParallelDims
from ndparallel.parallel.layout_refusals import qat_layout_problem, saved_modules_problem
from ndparallel.plan.adapters.qlora import nf4_shards_problem
from ndparallel.plan.field_marks import PIPELINE, flag, on_off, pin
from ndparallel.plan.hardware import GiB, Hardware
from ndparallel.plan.memory.peak import MemoryBreakdown, estimate_memory
from ndparallel.plan.models import ModelSpec
from ndparallel.plan.pipeline.pipeline_estimate import estimate_pipeline, measured, pipeline_memory
from ndparallel.plan.pipeline.schedule_model import AUTO_SCHEDULES, canonical, default_virtual
from ndparallel.plan.pipeline.schedule_model import problem as pipeline_problem
from ndparallel.plan.search.estimate import Estimate, TimeBreakdown, finish, rank_step
from ndparallel.plan.search.layouts import enumerate_layouts, structural_rejections
from ndparallel.plan.settings import Settings
from ndparallel.techniques.host_budget import HOST_BUDGET_FRACTION

__all__ = [
    "Estimate",
    "TimeBreakdown",
    "PlanRequest",
    "LayoutResult",
    "PlanResult",
    "estimate",
    "evaluate_layout",
    "plan",
]

DEFAULT_GLOBAL_BATCH_TOKENS = 2**22
"""Used when no global batch is given: ~4M tokens, rounded per layout (not enforced exactly)."""
AUTO_MICRO_BATCHES = (1, 2, 4, 8)


DEFAULT_SETTINGS = Settings(seq_len=4096, loss_impl="chunked")
"""A request's settings unless it gives its own: 4096 tokens, the chunked loss the trainer runs."""


@dataclass(frozen=True)
class PlanRequest:
    """What the user asks: model, cluster, hardware, the run's ``settings`` (the estimates' own
    vocabulary: one name per option) and what the search chooses per layout."""

    model: ModelSpec
    hardware: Hardware
    gpus: int
    gpus_per_node: int = 8
    settings: Settings = DEFAULT_SETTINGS
    """Everything of the run but the layout and the search's choices below (whose values in
    ``settings`` are not read: ``base_settings``)."""
    global_batch: int | None = None
    """Sequences per optimizer step; None: about DEFAULT_GLOBAL_BATCH_TOKENS (not enforced)."""
    micro_batch: int | None = field(
        default=None,
        metadata=flag("micro-batch per GPU, or auto (1,2,4,8)", default="auto")
        | pin("mb", "micro_batch_size"),
    )
    """None: try AUTO_MICRO_BATCHES."""
    checkpointing: str = field(default="auto", metadata=pin("ac", read=on_off))
    unsharded_grad_accumulation: bool | None = field(
        default=None,
        metadata=flag(
            "accumulate unsharded gradients, reduce-scatter only after the last micro-batch (train's "
            "fsdp_config.unsharded_grad_accumulation); auto (default): pp layouts try both, others "
            "reduce-scatter every micro-batch",
            nargs="?",
            const="on",
            default="auto",
            choices=("auto", "on", "off"),
        )
        | pin("uga", read=on_off),
    )
    """FSDP gradients accumulated unsharded, reduced once per step. None (auto): pp layouts try both
    (one reduction per step by each stage's FSDP root, or one per micro-batch: the runtime's
    default), other layouts reduce on every micro-batch; True / False: that, everywhere."""
    host_mem_bytes: float | None = None
    """Host memory per node; with offloading, layouts whose offloaded bytes per node exceed
    ``HOST_BUDGET_FRACTION`` of it are rejected (``host_oom``). None: not checked."""
    pipeline: bool = True
    """Search pipeline-parallel layouts too (``--no-pipeline-parallel``: pp = 1 only)."""
    pipeline_schedule: str = field(
        default="auto",
        metadata=flag(
            "pipeline schedule of the pp layouts: auto (1F1B and Interleaved1F1B), GPipe, 1F1B, "
            "Interleaved1F1B, InterleavedZeroBubble or ZBVZeroBubble (train's pipeline_schedule)",
            group=PIPELINE,
        )
        | pin("schedule", "sched", read=lambda _key, text: canonical(text)),
    )
    """'auto': 1F1B and Interleaved1F1B (2 stages per rank) for each pp layout; else that schedule."""
    pipeline_virtual_stages: int | None = field(
        default=None,
        metadata=flag(
            "stages per rank of the interleaved / zero-bubble schedules (default 2)",
            positive=True,
            group=PIPELINE,
        )
        | pin("v", "virtual"),
    )
    """Stages per rank of the multi-stage schedules (None: the runtime's default, 2)."""

    @classmethod
    def of(cls, model: ModelSpec, hardware: Hardware, gpus: int, **options) -> PlanRequest:
        """A request with ``DEFAULT_SETTINGS`` and ``options`` (see ``updated``)."""
        return cls(model, hardware, gpus).updated(**options)

    def updated(self, **options) -> PlanRequest:
        """This request with ``options`` replaced, each by its name: a field of the request's own,
        else one of its ``settings``."""
        own = {f.name for f in fields(self)}
        mine = {k: v for k, v in options.items() if k in own}
        rest = {k: v for k, v in options.items() if k not in own}
        return replace(self, **{**mine, "settings": replace(mine.get("settings", self.settings), **rest)})


@dataclass
class LayoutResult:
    """One layout: its best (micro-batch, checkpointing) option, all options, or why rejected."""

    layout: ParallelDims
    best: Estimate | None = None
    options: list[Estimate] = field(default_factory=list)
    rejections: list[tuple[str, str]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.best is not None

    def to_dict(self) -> dict:
        return {
            "layout": asdict(self.layout),
            "ok": self.ok,
            "best": self.best.to_dict() if self.best else None,
            "rejections": [{"code": c, "reason": r} for c, r in self.rejections],
        }


@dataclass
class PlanResult:
    request: PlanRequest
    ranked: list[LayoutResult]
    rejected: list[LayoutResult]

    def find(self, layout: ParallelDims) -> LayoutResult | None:
        return next((r for r in self.ranked + self.rejected if r.layout == layout), None)


# --------------------------------------------------------------- evaluation
def estimate(
    model: ModelSpec,
    layout: ParallelDims,
    s: Settings,
    hw: Hardware,
    gpus_per_node: int,
    global_batch: int | None = None,
    known: tuple = (),
) -> Estimate:
    """Memory and step time of one fully specified configuration (no validity checks); a pp
    layout is its slowest pipeline rank's pace plus the schedule's bubble (``pipeline_estimate``).
    ``known``: what ``memory_cut`` returned for it (its memory, computed once)."""
    if layout.pp > 1:
        return estimate_pipeline(model, layout, s, hw, gpus_per_node, global_batch, known)
    mem, colls, timeb = rank_step(model, layout, s, hw, gpus_per_node, known[0][4] if known else None)
    return finish(model, layout, s, hw, mem, colls, timeb, global_batch)


def memory(model: ModelSpec, layout: ParallelDims, s: Settings, hw: Hardware) -> MemoryBreakdown:
    """The memory ``estimate`` reports, without costing the step's time (a third of the work)."""
    return pipeline_memory(model, layout, s, hw, memory_cut(model, layout, s, hw))


def memory_cut(model: ModelSpec, layout: ParallelDims, s: Settings, hw: Hardware) -> tuple:
    """The ranks ``estimate`` models with their memory (``pipeline_estimate.measured``; one
    (0, None, model, s, memory) without PP): ``estimate(known=...)`` reuses them."""
    if layout.pp > 1:
        return measured(model, layout, s, hw)
    return ((0, None, model, s, estimate_memory(model, layout, s, hw)),)


def _grad_accum(req: PlanRequest, layout: ParallelDims, mb: int) -> tuple[int | None, str | None]:
    per_step = layout.dp * mb
    if req.global_batch is None:
        target = max(1, round(DEFAULT_GLOBAL_BATCH_TOKENS / req.settings.seq_len))
        return max(1, round(target / per_step)), None
    if req.global_batch % per_step:
        return None, (
            f"global batch {req.global_batch} is not divisible by dp × micro_batch = "
            f"{layout.dp} × {mb} = {per_step}"
        )
    return req.global_batch // per_step, None


PER_LAYOUT = ("micro_batch", "checkpointing", "unsharded_grad_accumulation")
"""``Settings`` fields the request holds itself: choices the search makes per layout
(``evaluate_layout``), auto unless pinned."""


def base_settings(req: PlanRequest) -> Settings:
    """The request's settings before a layout's micro-batch, accumulation and checkpointing, the
    request's ``unsharded_grad_accumulation`` auto (None) as off."""
    return replace(req.settings, unsharded_grad_accumulation=bool(req.unsharded_grad_accumulation))


def _layout_rejections(req: PlanRequest, layout: ParallelDims, base: Settings) -> list[tuple[str, str]]:
    out = structural_rejections(layout, req.model, req.gpus, req.gpus_per_node, base)
    if base.quantized_base:
        why = nf4_shards_problem(req.model, layout)
        out += [("qlora_layout", why)] if why else []
    # the runtime's own refusals, asked with the planner's layout
    why = saved_modules_problem(base.lora_saved, layout.tp)
    out += [("lora_layout", why)] if why else []
    why = qat_layout_problem(layout.tp, float8=False) if base.qat else None
    out += [("qat_layout", why)] if why else []
    return out


DEEPEST_INTERLEAVE = 8
"""Besides ``AUTO_SCHEDULES``, the search tries Interleaved1F1B as deep as every stage keeps a layer,
up to this many stages per rank (Meta's Llama-3.1-405B ran 8; Megatron's interleaving guidance is a
few): on 8,192 H100s it finds 39.0 % where v = 2's best is 36.6 % (docs/planner_derivation.md)."""


def _schedules(
    req: PlanRequest, layout: ParallelDims, schedule: str | None, virtual: int | None
) -> list[tuple[str, int]]:
    """(pipeline schedule, stages per rank) options of a layout: one placeholder without PP; with
    ``auto``, ``AUTO_SCHEDULES`` and the deepest interleave (``DEEPEST_INTERLEAVE``)."""
    if layout.pp == 1:
        return [("1F1B", 1)]
    schedule = schedule or (None if req.pipeline_schedule == "auto" else canonical(req.pipeline_schedule))
    virtual = virtual or req.pipeline_virtual_stages
    if schedule:
        return [(schedule, virtual or default_virtual(schedule))]
    options = [(name, virtual if virtual and v > 1 else v) for name, v in AUTO_SCHEDULES]
    deep = min(req.model.layers // layout.pp, DEEPEST_INTERLEAVE)
    if not virtual and deep > 2:  # the smallest bubble, the most micro-batches in flight
        options.append(("Interleaved1F1B", deep))
    return options


def _grad_syncs(req: PlanRequest, layout: ParallelDims, unsharded: bool | None) -> list[bool]:
    """``unsharded_grad_accumulation`` values tried: the pinned one, else the request's, else (auto)
    both for a pp layout with FSDP or replicas, the runtime's default (False) otherwise."""
    if unsharded is not None or req.unsharded_grad_accumulation is not None:
        return [req.unsharded_grad_accumulation if unsharded is None else unsharded]
    return [False, True] if layout.pp > 1 and layout.dp_replicate * layout.fsdp > 1 else [False]


def evaluate_layout(
    req: PlanRequest,
    layout: ParallelDims,
    micro_batch: int | None = None,
    checkpointing: bool | None = None,
    pipeline_schedule: str | None = None,
    pipeline_virtual_stages: int | None = None,
    unsharded_grad_accumulation: bool | None = None,
    skip_unfit: bool = False,
    base: Settings | None = None,
) -> LayoutResult:
    """All (micro-batch, checkpointing, pipeline schedule, gradient reduction) options of one
    layout; the best that fits is ``best``. The request's per-layout choices given by name (as
    ``--explain``'s keys give them: ``parse_layout``) pin it: ``pipeline_schedule`` /
    ``pipeline_virtual_stages`` a pp layout's schedule and stages per rank.

    ``skip_unfit`` (the search's): an option whose memory does not fit the device is not costed
    further and not kept in ``options`` (the same ``best`` and rejection, about 2× faster where
    most options do not fit; ``--explain`` evaluates its layout without it, every option shown).
    ``base``: ``base_settings(req)``, when the caller has it (the search: once per request)."""
    res = LayoutResult(layout)
    base = base or base_settings(req)
    res.rejections = _layout_rejections(req, layout, base)
    if res.rejections:
        return res
    mbs = [micro_batch] if micro_batch else [req.micro_batch] if req.micro_batch else list(AUTO_MICRO_BATCHES)
    if checkpointing is not None:
        acs = [checkpointing]
    elif base.activation_offloading:  # offloading moves what checkpointing (full or selective) keeps
        acs = [True]
    else:
        acs = {"auto": [False, True], "on": [True], "off": [False]}[req.checkpointing]
    reasons: dict[str, list[str]] = {"global_batch": [], "pp_microbatches": []}
    unfit: list[tuple[MemoryBreakdown, Settings]] = []
    for mb in mbs:
        ga, why = _grad_accum(req, layout, mb)
        if ga is None:
            reasons["global_batch"].append(why)
            continue
        for name, v in _schedules(req, layout, pipeline_schedule, pipeline_virtual_stages):
            why = pipeline_problem(name, layout.pp, v, req.model.layers, ga) if layout.pp > 1 else None
            if why:
                reasons["pp_microbatches"].append(f"micro_batch={mb}: {why}")
                continue
            for ac in acs:
                for uga in _grad_syncs(req, layout, unsharded_grad_accumulation):
                    s = base.but(
                        micro_batch=mb,
                        grad_accum=ga,
                        checkpointing=ac,
                        pp_schedule=name,
                        pp_virtual=v,
                        unsharded_grad_accumulation=uga,
                    )
                    known = memory_cut(req.model, layout, s, req.hardware) if skip_unfit else ()
                    mem = known and pipeline_memory(req.model, layout, s, req.hardware, known)
                    if mem and mem.total > req.hardware.mem_bytes:
                        unfit.append((mem, s))
                        continue
                    res.options.append(
                        estimate(req.model, layout, s, req.hardware, req.gpus_per_node, known=known)
                    )
    _choose(req, layout, res, reasons, unfit)
    return res


def _choose(
    req: PlanRequest,
    layout: ParallelDims,
    res: LayoutResult,
    reasons: dict[str, list[str]],
    unfit: list[tuple[MemoryBreakdown, Settings]],
) -> None:
    """``res.best``: the fastest option that fits; else the one rejection that explains why none
    (``unfit``: the (memory, settings) of options not costed further, none of which fits)."""
    host_problem = _check_host(req, layout, res.options)
    fitting = [o for o in res.options if o.fits]
    if fitting:
        res.best = max(fitting, key=lambda o: (o.tokens_per_s_per_gpu, -o.memory.total))
    elif host_problem:
        res.rejections = [("host_oom", host_problem)]
    elif res.options or unfit:
        least_mem, s = min([(o.memory, o.settings) for o in res.options] + unfit, key=lambda o: o[0].total)
        res.rejections = [
            (
                "oom",
                (
                    f"out of memory: needs {least_mem.total / GiB:.1f} GiB > "
                    f"{req.hardware.mem_bytes / GiB:.1f} GiB even with micro_batch={s.micro_batch}, "
                    f"checkpointing {'on' if s.checkpointing else 'off'}"
                    + (f", {s.pp_schedule}" if layout.pp > 1 else "")
                ),
            )
        ]
    else:
        code = "pp_microbatches" if reasons["pp_microbatches"] else "global_batch"
        res.rejections = [(code, reasons[code][0])]


def _check_host(req: PlanRequest, layout: ParallelDims, options: list[Estimate]) -> str | None:
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
            reason = (
                f"offloaded activations need {need / GiB:.0f} GiB of host memory per node "
                f"({per_node} GPUs × {o.memory.host_offload / GiB:.1f}) > {HOST_BUDGET_FRACTION:.0%} "
                f"of --host-mem {req.host_mem_bytes / GiB:.0f} GiB"
            )
    return reason if reason and not any(o.fits for o in options) else None


def plan(req: PlanRequest) -> PlanResult:
    """Evaluate every layout of ``req.gpus`` ranks; rank those that fit by tokens/s per GPU."""
    if req.gpus < 1:
        raise ValueError("--gpus must be >= 1")
    layers = req.model.layers if req.pipeline else 0
    base = base_settings(req)
    results = [
        evaluate_layout(req, lay, skip_unfit=True, base=base)
        for lay in enumerate_layouts(req.gpus, req.model.num_experts, layers)
    ]
    ranked = sorted(
        (r for r in results if r.ok), key=lambda r: (-r.best.tokens_per_s_per_gpu, r.best.memory.total)
    )
    rejected = [r for r in results if not r.ok]
    return PlanResult(req, ranked, rejected)
