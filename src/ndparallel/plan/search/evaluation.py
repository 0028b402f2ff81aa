"""Evaluate one layout (memory, step time, throughput) under each of its options and search all
layouts: ``evaluate_layout`` and ``plan``."""

from __future__ import annotations

from ndparallel.layout.dims import ParallelDims
from ndparallel.parallel.layout_refusals import qat_layout_problem, saved_modules_problem
from ndparallel.plan.adapters.qlora import nf4_shards_problem
from ndparallel.plan.hardware import GiB, Hardware
from ndparallel.plan.memory.peak import MemoryBreakdown, estimate_memory
from ndparallel.plan.models import ModelSpec
from ndparallel.plan.pipeline.pipeline_estimate import estimate_pipeline, measured, pipeline_memory
from ndparallel.plan.pipeline.schedule_model import problem as pipeline_problem
from ndparallel.plan.search import choices
from ndparallel.plan.search.estimate import Estimate, finish, rank_step
from ndparallel.plan.search.layouts import enumerate_layouts, structural_rejections
from ndparallel.plan.search.request import LayoutResult, PlanRequest, PlanResult, base_settings
from ndparallel.plan.settings import Settings
from ndparallel.techniques.host_budget import HOST_BUDGET_FRACTION


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


def _layout_rejections(req: PlanRequest, layout: ParallelDims, base: Settings) -> list[tuple[str, str]]:
    out = structural_rejections(layout, req.model, req.gpus, req.gpus_per_node, base)
    if base.load_in_4bit:
        why = nf4_shards_problem(req.model, layout)
        out += [("qlora_layout", why)] if why else []
    # the runtime's own refusals, asked with the planner's layout
    why = saved_modules_problem(base.lora_saved, layout.tp)
    out += [("lora_layout", why)] if why else []
    why = qat_layout_problem(layout.tp, float8=False) if base.qat else None
    out += [("qat_layout", why)] if why else []
    return out


def evaluate_layout(
    req: PlanRequest,
    layout: ParallelDims,
    micro_batch_size: int | None = None,
    activation_checkpointing: bool | None = None,
    pipeline_schedule: str | None = None,
    pipeline_virtual_stages: int | None = None,
    unsharded_grad_accumulation: bool | None = None,
    skip_unfit: bool = False,
    base: Settings | None = None,
) -> LayoutResult:
    """All options of one layout (each searched setting's candidates: ``choices.py``); the best that
    fits is ``best``. A searched setting given by name (as ``--explain``'s keys give them:
    ``plan/cli/explain_keys.py``) pins it for this layout.

    ``skip_unfit`` (the search's): an option whose memory does not fit the device is not costed
    further and not kept in ``options`` (the same ``best`` and rejection, about 2× faster where
    most options do not fit; ``--explain`` evaluates its layout without it, every option shown).
    ``base``: ``base_settings(req)``, when the caller has it (the search: once per request)."""
    res = LayoutResult(layout)
    base = base or base_settings(req)
    res.rejections = _layout_rejections(req, layout, base)
    if res.rejections:
        return res
    acs = choices.checkpointing(req, base, activation_checkpointing)
    reasons: dict[str, list[str]] = {"global_batch": [], "pp_microbatches": []}
    unfit: list[tuple[MemoryBreakdown, Settings]] = []
    for mb in choices.micro_batch_sizes(req, micro_batch_size):
        ga, why = choices.gradient_accumulation_steps(req, layout, mb)
        if ga is None:
            reasons["global_batch"].append(why)
            continue
        for name, v in choices.schedules(req, layout, pipeline_schedule, pipeline_virtual_stages):
            why = pipeline_problem(name, layout.pp, v, req.model.layers, ga) if layout.pp > 1 else None
            if why:
                reasons["pp_microbatches"].append(f"micro_batch_size={mb}: {why}")
                continue
            for ac in acs:
                for uga in choices.grad_syncs(req, layout, unsharded_grad_accumulation):
                    s = base.but(
                        micro_batch_size=mb,
                        gradient_accumulation_steps=ga,
                        activation_checkpointing=ac,
                        pipeline_schedule=name,
                        pipeline_virtual_stages=v,
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
                    f"{req.hardware.mem_bytes / GiB:.1f} GiB even with micro_batch_size="
                    f"{s.micro_batch_size}, activation_checkpointing "
                    f"{'on' if s.activation_checkpointing else 'off'}"
                    + (f", {s.pipeline_schedule}" if layout.pp > 1 else "")
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
    layers = req.model.layers if req.pipeline_parallel else 0
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
