"""Evaluate one layout (memory, step time, throughput) under each of its options and search all
layouts: ``evaluate_layout`` and ``plan``."""

from __future__ import annotations

import heapq

from ndparallel.layout.dims import ParallelDims
from ndparallel.parallel.layout_refusals import qat_layout_problem, saved_modules_problem
from ndparallel.plan.adapters.qlora import nf4_shards_problem
from ndparallel.plan.hardware import GiB, Hardware
from ndparallel.plan.memory.peak import MemoryBreakdown, estimate_memory, resident_bytes
from ndparallel.plan.models import ModelSpec
from ndparallel.plan.pipeline.pipeline_estimate import (
    each_measured,
    estimate_pipeline,
    measured,
    pipeline_memory,
    pp_rank,
)
from ndparallel.plan.pipeline.schedule_model import measured_ranks
from ndparallel.plan.pipeline.schedule_model import problem as pipeline_problem
from ndparallel.plan.search import bounds, choices
from ndparallel.plan.search.estimate import Estimate, finish, rank_step
from ndparallel.plan.search.layouts import enumerate_layouts, structural_rejections
from ndparallel.plan.search.request import SEARCHED, LayoutResult, PlanRequest, PlanResult, base_settings
from ndparallel.plan.settings import Settings
from ndparallel.runtime.startup import paused_collector
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


def memory_cut(
    model: ModelSpec, layout: ParallelDims, s: Settings, hw: Hardware, cap: float | None = None
) -> tuple:
    """The ranks ``estimate`` models with their memory (``pipeline_estimate.measured``; one
    (0, None, model, s, memory) without PP): ``estimate(known=...)`` reuses them. ``cap``: stop
    after the first rank whose memory exceeds it (the option does not fit: the search's cut)."""
    if layout.pp == 1:
        return ((0, None, model, s, estimate_memory(model, layout, s, hw)),)
    if cap is None:
        return measured(model, layout, s, hw)
    out = []
    for rank in each_measured(model, layout, s, hw):
        out.append(rank)
        if rank[4].total > cap:
            break
    return tuple(out)


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
    req: PlanRequest, layout: ParallelDims, skip_unfit: bool = False, base: Settings | None = None, **pins
) -> LayoutResult:
    """All options of one layout (each searched setting's candidates: ``choices.py``); the best that
    fits is ``best``. A searched setting given by name (``request.SEARCHED``, as ``--explain``'s keys
    give them: ``plan/cli/explain_keys.py``) pins it for this layout. The tiled MLP (unless pinned)
    is tried only where no untiled option fits.

    ``skip_unfit`` (the search's): only what can still be the best is costed (``bounds.py``: options
    in the order of their bound on tokens/s, none whose bound is below the best so far, none whose
    resident states exceed the device, none a faster option that fits dominates) and ``options``
    keeps the costed ones that fit; the same ``best`` and rejection as without it. ``--explain``
    evaluates its layout without it: every option costed and shown.
    ``base``: ``base_settings(req)``, when the caller has it (the search: once per request)."""
    unknown = set(pins) - set(SEARCHED)
    if unknown:
        raise TypeError(f"evaluate_layout: {sorted(unknown)} are no searched setting ({', '.join(SEARCHED)})")
    res = LayoutResult(layout)
    base = base or base_settings(req)
    res.rejections = _layout_rejections(req, layout, base)
    if res.rejections:
        return res
    reasons: dict[str, list[str]] = {"global_batch": [], "pp_microbatches": []}
    unfit: list[tuple[float, Settings | None]] = []
    for tiled in choices.tiling(req, pins.get("tiled_mlp")):
        groups = _option_groups(req, layout, base.but(tiled_mlp=tiled), pins, reasons)
        res.searched += sum(len(g) for g in groups)
        if skip_unfit:
            _bound(req, layout, groups, res, unfit)
        else:
            for s in (s for g in groups for s in g):
                _cost(req, layout, s, (), res)
        if any(o.fits for o in res.options):
            break
    _choose(req, layout, res, reasons, unfit)
    return res


def _option_groups(
    req: PlanRequest, layout: ParallelDims, base: Settings, pins: dict, reasons: dict
) -> list[list[Settings]]:
    """Every option of ``layout`` (the product of the searched settings' candidates), grouped by what
    its compute reads (micro-batch, schedule, checkpointing policy: ``bounds.step_floor``'s), each
    group's options varying only what its communication and memory read (gradient reduction,
    resharding, offloading), each after those that dominate it (``bounds.dominators``); ``reasons``:
    why a micro-batch or schedule cannot run."""
    return [
        _members(compute, variants) for compute, variants in _group_specs(req, layout, base, pins, reasons)
    ]


Variant = tuple
"""(``unsharded_grad_accumulation``, ``reshard_after_forward``, ``activation_offloading``) of an
option of a group."""


def _members(compute: Settings, variants: list[Variant]) -> list[Settings]:
    """The options of a group (``_group_specs``)."""
    return [
        compute.but(unsharded_grad_accumulation=uga, reshard_after_forward=raf, activation_offloading=o)
        for uga, raf, o in variants
    ]


def _group_specs(
    req: PlanRequest, layout: ParallelDims, base: Settings, pins: dict, reasons: dict
) -> list[tuple[Settings, list[Variant]]]:
    """``_option_groups`` before its options are built: each group's settings of its compute and
    its options' variants."""
    out = []
    ckpt = choices.checkpointing(
        req, pins.get("activation_checkpointing"), pins.get("ac_policy"), pins.get("activation_offloading")
    )
    keeps = choices.reshards(req, layout, base, pins.get("reshard_after_forward"))
    syncs = choices.grad_syncs(req, layout, pins.get("unsharded_grad_accumulation"))
    for mb in choices.micro_batch_sizes(req, pins.get("micro_batch_size")):
        ga, why = choices.gradient_accumulation_steps(req, layout, mb)
        if ga is None:
            reasons["global_batch"].append(why)
            continue
        pinned = pins.get("pipeline_schedule"), pins.get("pipeline_virtual_stages")
        for name, v in choices.schedules(req, layout, *pinned):
            why = pipeline_problem(name, layout.pp, v, req.model.layers, ga) if layout.pp > 1 else None
            if why:
                reasons["pp_microbatches"].append(f"micro_batch_size={mb}: {why}")
                continue
            step = base.but(
                micro_batch_size=mb,
                gradient_accumulation_steps=ga,
                pipeline_schedule=name,
                pipeline_virtual_stages=v,
            )
            for policy in dict.fromkeys((ac, policy) for ac, policy, _ in ckpt):
                offloads = [o for ac, p, o in ckpt if (ac, p) == policy]
                compute = step.but(activation_checkpointing=policy[0], ac_policy=policy[1])
                out.append((compute, [(uga, raf, o) for uga in syncs for raf in keeps for o in offloads]))
    return out


def _bound(
    req: PlanRequest,
    layout: ParallelDims,
    groups: list[list[Settings]],
    res: LayoutResult,
    unfit: list,
    floor: float | None = None,
) -> None:
    """Cost what can still be the best of the options (``bounds.py``), the group of the highest bound
    on tokens/s first: each group ordered by its ``tokens_per_s_bound``, then, when it comes first,
    by the highest ``option_bound`` of its options (computed only then); an option whose own bound
    is below the best so far (or below ``floor``, when given) is not tried. The options not costed
    for memory go to ``unfit`` with the bytes they need at least."""
    model, hw, g = req.model, req.hardware, req.gpus_per_node
    heap = [
        (-bounds.tokens_per_s_bound(model, layout, grp[0], hw, g), i, None) for i, grp in enumerate(groups)
    ]
    heapq.heapify(heap)
    resident: dict[tuple, float] = {}
    fitted = {bounds.option_key(o.settings) for o in res.options if o.fits}
    best = max((o.tokens_per_s_per_gpu for o in res.options if o.fits), default=None)
    bar = floor if best is None else best if floor is None else max(best, floor)
    while heap:
        bound, i, own = heapq.heappop(heap)
        if bar is not None and -bound < bar * (1 - bounds.ROUNDING):
            break
        if own is None and bar is not None:  # its options' own bounds, then back in line
            own = _own_bounds(req, layout, groups[i])
            heapq.heappush(heap, (-min(-bound, max(own)), i, own))
            continue
        for s, option in zip(groups[i], own or [0.0] * len(groups[i])):
            if own and option < bar * (1 - bounds.ROUNDING):
                continue
            if any(d in fitted for d in bounds.dominators(layout, s)):
                continue
            where = (s.pipeline_schedule, s.pipeline_virtual_stages)
            if where not in resident:
                resident[where] = max(
                    resident_bytes(part, layout, rs, hw) for part, rs in _ranks(model, layout, s)
                )
            if resident[where] > hw.mem_bytes:
                unfit.append((resident[where], None))
                continue
            # once an option fits, one rank out of memory is enough (the least needed is not asked)
            known = memory_cut(model, layout, s, hw, None if best is None else hw.mem_bytes)
            mem = pipeline_memory(model, layout, s, hw, known)
            res.memory_checked += 1
            if mem.total > hw.mem_bytes:
                unfit.append((mem.total, s))
                continue
            e = _cost(req, layout, s, known, res)
            if e.fits:
                fitted.add(bounds.option_key(s))
                best = max(best or 0.0, e.tokens_per_s_per_gpu)
                bar = max(bar or 0.0, best)


def _own_bounds(req: PlanRequest, layout: ParallelDims, group: list[Settings]) -> list[float]:
    """``bounds.option_bound`` of each option of a group: computed once per data-parallel settings
    (``bounds.DP_FIELDS``, what it reads of an option besides the group's ``rank_floors``)."""
    model, hw, g = req.model, req.hardware, req.gpus_per_node
    floors = bounds.rank_floors(model, layout, group[0], hw, g)
    seen: dict[tuple, float] = {}
    out = []
    for s in group:
        key = bounds.DP_FIELDS(s)
        if key not in seen:
            seen[key] = bounds.option_bound(model, layout, s, hw, g, floors)
        out.append(seen[key])
    return out


def _ranks(model: ModelSpec, layout: ParallelDims, s: Settings) -> list[tuple[ModelSpec, Settings]]:
    """(part of the model, settings) of each rank ``estimate`` models."""
    if layout.pp == 1:
        return [(model, s)]
    return [pp_rank(model, layout, s, rank)[1:] for rank in measured_ranks(layout.pp, s.pipeline_schedule)]


def _cost(req: PlanRequest, layout: ParallelDims, s: Settings, known: tuple, res: LayoutResult) -> Estimate:
    """The option's estimate, kept in ``res.options``; not fitting where its offloaded activations
    exceed the node's host budget (``host_problem``)."""
    e = estimate(req.model, layout, s, req.hardware, req.gpus_per_node, known=known)
    res.costed += 1
    if e.fits:
        why = host_problem(req, layout, e)
        if why:
            e.fits = False
            res.host_problems.append(why)
    res.options.append(e)
    return e


def _choose(
    req: PlanRequest,
    layout: ParallelDims,
    res: LayoutResult,
    reasons: dict[str, list[str]],
    unfit: list[tuple[float, Settings | None]],
) -> None:
    """``res.best``: the fastest option that fits (the less memory of two as fast); else the one
    rejection that explains why none (``unfit``: (bytes needed at least, settings or None where only
    the resident states were counted) of options not costed further, none of which fits)."""
    fitting = [o for o in res.options if o.fits]
    if fitting:
        res.best = max(fitting, key=preference)
    elif res.host_problems:  # some fit the device, and not the node's host memory
        res.rejections = [("host_oom", res.host_problems[-1])]
    elif res.options or unfit:
        needs = [(o.memory.total, o.settings) for o in res.options] + unfit
        least, s = min(needs, key=lambda x: (x[0], x[1] is None))
        cap = req.hardware.mem_bytes / GiB
        if s is None:
            why = (
                "out of memory: the parameters, gradients and optimizer states alone need "
                f"{least / GiB:.1f} GiB > {cap:.1f} GiB"
            )
        else:
            why = (
                f"out of memory: needs {least / GiB:.1f} GiB > {cap:.1f} GiB even with "
                f"micro_batch_size={s.micro_batch_size}, {describe_settings(s, layout)}"
            )
        res.rejections = [("oom", why)]
    else:
        code = "pp_microbatches" if reasons["pp_microbatches"] else "global_batch"
        res.rejections = [(code, reasons[code][0])]


def preference(e: Estimate) -> tuple:
    """How ``_choose`` orders the options that fit: the fastest; of two as fast, the one that keeps
    its activations on the device, then the one that keeps its parameters gathered after forward
    (the modelled time of both is equal only where the model hides their copies or gathers, what it
    is least sure of), then the less memory. ``bounds.dominators`` relies on that order: a dominating
    option is preferred on a tie."""
    s = e.settings
    return (e.tokens_per_s_per_gpu, not s.activation_offloading, not s.reshard_after_forward, -e.memory.total)


def describe_settings(s: Settings, layout: ParallelDims) -> str:
    """The searched settings of an option in words: checkpointing and its policy, offloading,
    resharding, tiling, and its pipeline schedule."""
    words = ["activation_checkpointing " + ("off" if s.recompute == "none" else f"on ({s.ac_policy})")]
    words += ["activation_offloading"] if s.activation_offloading and s.activation_checkpointing else []
    words += ["reshard_after_forward off"] if not s.reshard_after_forward else []
    words += ["tiled_mlp"] if s.tiled_mlp else []
    words += [s.pipeline_schedule] if layout.pp > 1 else []
    return ", ".join(words)


def host_problem(req: PlanRequest, layout: ParallelDims, e: Estimate) -> str | None:
    """Why an option's offloaded activations do not fit the node's host budget, or None."""
    return _host_problem(req, layout, e.memory.host_offload)


def _host_problem(req: PlanRequest, layout: ParallelDims, host_offload: float) -> str | None:
    """``host_problem`` of a GPU's ``host_offload`` bytes."""
    if req.host_mem_bytes is None:
        return None
    per_node = min(req.gpus_per_node, layout.world)
    budget = HOST_BUDGET_FRACTION * req.host_mem_bytes
    need = host_offload * per_node
    if need <= budget:
        return None
    return (
        f"offloaded activations need {need / GiB:.0f} GiB of host memory per node "
        f"({per_node} GPUs × {host_offload / GiB:.1f}) > {HOST_BUDGET_FRACTION:.0%} "
        f"of {host_mem_text(req)}"
    )


def host_mem_text(req: PlanRequest) -> str:
    """Where the host memory per node comes from, in words: ``--host-mem``'s or the preset's."""
    size = f"{req.host_mem_bytes / GiB:.0f} GiB"
    if req.host_mem_preset:
        return f"the {req.hardware.name} preset's {size} per node (a DGX server's; --host-mem sets it)"
    return f"--host-mem {size}"


def plan(req: PlanRequest, top: int | None = None) -> PlanResult:
    """Evaluate every layout of ``req.gpus`` ranks; rank those that fit by tokens/s per GPU.

    ``top``: only the best ``top`` layouts are ranked (``PlanResult.fitting`` counts every one that
    fits, ``rejected`` lists every one that does not, as without it): only the layouts whose
    bound on tokens/s can still reach the best ``top`` are evaluated (``_top``)."""
    if req.gpus < 1:
        raise ValueError("--gpus must be >= 1")
    layers = req.model.layers if req.pipeline_parallel else 0
    base = base_settings(req)
    layouts = enumerate_layouts(req.gpus, req.model.num_experts, layers)
    with paused_collector():  # ~10^6 short-lived acyclic objects: the collector only walks them
        if top is None:
            results = [evaluate_layout(req, lay, skip_unfit=True, base=base) for lay in layouts]
        else:
            results = _top(req, layouts, base, top)
    done = [(i, r) for i, r in enumerate(results) if isinstance(r, LayoutResult)]
    ranked = [r for _, r in sorted(((i, r) for i, r in done if r.ok), key=lambda x: (_rank_key(x[1]), x[0]))]
    rejected = [r for _, r in done if not r.ok]
    if top is None:
        return PlanResult(req, ranked, rejected)
    return PlanResult(req, ranked[:top], rejected, fitting=len(results) - len(rejected))


def _rank_key(r: LayoutResult) -> tuple:
    return (-r.best.tokens_per_s_per_gpu, r.best.memory.total)


def _top(req: PlanRequest, layouts: list[ParallelDims], base: Settings, top: int) -> list:
    """Per layout its ``LayoutResult`` where evaluated, else True: it fits (not among the best
    ``top``). Best first over the option groups (``_option_groups``) of every class of layouts
    (``_class_key``: what the groups and their bound read; one class holds a (pp, cp, tp)'s
    splits of data parallel into replicas and shards), each level's bound on tokens/s at least
    the next's: a class's groups of one micro-batch, schedule and tiling by the bound without
    checkpointing (``bounds.relaxed``); when that comes first, each group by its own
    (``bounds.tokens_per_s_bound``); when that comes first, the group in each layout of the class
    by its options' (``bounds.option_bound``; none where its resident states exceed the device);
    when that comes first, its layout evaluated. Until ``top`` layouts are evaluated that fit, the
    ``top``-th best above every bound left. The others: rejected or not as ``evaluate_layout``
    says (``_some_option_fits`` first)."""
    out: list = [None] * len(layouts)
    classes: dict[tuple, list[int]] = {}
    for i, lay in enumerate(layouts):
        if _layout_rejections(req, lay, base):  # rejected before any option is costed
            out[i] = evaluate_layout(req, lay, skip_unfit=True, base=base)
        else:
            classes.setdefault(_class_key(req.model, lay), []).append(i)
    search = _TopSearch(req, layouts, base, out)
    for members in classes.values():
        search.add_class(members)
    search.run(top)
    for i, lay in enumerate(layouts):
        if out[i] is None:
            others = search.others_of(i)
            some = search.fits[i] or bool(others) and _some_option_fits(req, lay, others)
            out[i] = some or evaluate_layout(req, lay, skip_unfit=True, base=base)
    return out


def _class_key(model: ModelSpec, layout: ParallelDims) -> tuple:
    """The layouts whose option groups (``_group_specs``: pp, dp, dp·cp) and their bounds
    (``bounds.tokens_per_s_bound``: a dense model's pp, cp, tp, and dp, world) are the same."""
    return (layout,) if model.is_moe else (layout.pp, layout.dp, layout.cp, layout.tp)


class _TopSearch:
    """``_top``'s heap of bounds, one class of layouts (``_class_key``) at a time: its entries
    (-bound, level, where, which), level 0 a class's step (``which``: micro-batch, schedule and
    tiling) with several checkpointing groups, 1 a class's group, 2 a layout's group."""

    def __init__(self, req: PlanRequest, layouts: list[ParallelDims], base: Settings, out: list) -> None:
        self.req, self.layouts, self.base, self.out = req, layouts, base, out
        self.first_tiling, *self.other_tilings = choices.tiling(req, None)
        self.members: list[list[int]] = []  # per class: its layouts
        self.specs: list[list[tuple[Settings, list[Variant]]]] = []  # per class: its groups
        self.firsts: list[int] = []  # per class: its groups of the first tiling
        self.steps: list[list[list[int]]] = []  # per class: its groups by step
        self.fits: dict[int, bool] = {}
        self.cls: dict[int, int] = {}
        self.heap: list = []

    def add_class(self, members: list[int]) -> None:
        req, base = self.req, self.base
        lay = self.layouts[members[0]]
        specs = _specs(req, lay, base, self.first_tiling)
        if not specs:  # no option runs: each layout rejected as ``evaluate_layout`` says
            for i in members:
                self.out[i] = evaluate_layout(req, self.layouts[i], skip_unfit=True, base=base)
            return
        c, n = len(self.members), len(specs)
        # where an option of the first tiling fits, ``evaluate_layout`` tries no other
        lean = _leanest(specs)
        for i in members:
            self.cls[i] = c
            self.fits[i] = _fits(req, self.layouts[i], lean)
        if not all(self.fits[i] for i in members):
            specs = specs + [spec for t in self.other_tilings for spec in _specs(req, lay, base, t)]
        self.members.append(members)
        self.specs.append(specs)
        self.firsts.append(n)
        steps: dict[tuple, list[int]] = {}
        for j, (compute, _) in enumerate(specs):
            key = (compute.micro_batch_size, compute.pipeline_schedule, compute.pipeline_virtual_stages)
            steps.setdefault((*key, compute.tiled_mlp), []).append(j)
        self.steps.append(list(steps.values()))
        model, hw, g = req.model, req.hardware, req.gpus_per_node
        for k, js in enumerate(self.steps[c]):
            if len(js) == 1:
                self._push_group(c, js[0])
            else:
                first = _members(*specs[js[0]])[0]
                self.heap.append((-bounds.relaxed_bound(model, lay, first, hw, g), 0, c, k))

    def _push_group(self, c: int, j: int) -> None:
        req = self.req
        lay = self.layouts[self.members[c][0]]
        first = _members(self.specs[c][j][0], self.specs[c][j][1][:1])[0]
        bound = bounds.tokens_per_s_bound(req.model, lay, first, req.hardware, req.gpus_per_node)
        heapq.heappush(self.heap, (-bound, 1, c, j))

    def _above(self, i: int, floor: float) -> LayoutResult | None:
        """``evaluate_layout`` of layout ``i`` where its best reaches ``floor`` (the options whose
        bound is below it not tried), else None: below it. Only for a layout where an option of the
        first tiling fits (``evaluate_layout`` tries no other). The best, where it reaches
        ``floor``, is ``evaluate_layout``'s: no option that can reach it is skipped."""
        req, lay = self.req, self.layouts[i]
        res, unfit = LayoutResult(lay), []
        reasons: dict[str, list[str]] = {"global_batch": [], "pp_microbatches": []}
        groups = _option_groups(req, lay, self.base.but(tiled_mlp=self.first_tiling), {}, reasons)
        res.searched = sum(len(g) for g in groups)
        _bound(req, lay, groups, res, unfit, floor)
        if max((o.tokens_per_s_per_gpu for o in res.options if o.fits), default=0.0) < floor:
            return None
        _choose(req, lay, res, reasons, unfit)
        return res

    def others_of(self, i: int) -> list[tuple[Settings, list[Variant]]]:
        """The groups of the other tilings of layout ``i`` (none where the first tiling fits)."""
        c = self.cls.get(i)
        return [] if c is None or self.fits[i] else self.specs[c][self.firsts[c] :]

    def run(self, top: int) -> None:
        req, heap, out = self.req, self.heap, self.out
        model, hw = req.model, req.hardware
        heapq.heapify(heap)
        best: list[float] = []  # the tokens/s of the best ``top`` evaluated so far, a min-heap
        while heap and not (len(best) == top and -heap[0][0] < best[0] * (1 - bounds.ROUNDING)):
            bound, level, where, which = heapq.heappop(heap)
            if level == 0:  # a step's groups, each by its own bound
                for j in self.steps[where][which]:
                    self._push_group(where, j)
            elif level == 1:  # the group in each layout of its class, by its options' bounds
                grp = _members(*self.specs[where][which])
                tiled = which >= self.firsts[where]
                for i in self.members[where]:
                    if out[i] is not None or tiled and self.fits[i]:
                        continue
                    if _resident(model, self.layouts[i], grp[0], hw) <= hw.mem_bytes:
                        own = max(_own_bounds(req, self.layouts[i], grp))
                        heapq.heappush(heap, (-min(-bound, own), 2, i, which))
            elif out[where] is None:
                if len(best) == top and self.fits[where]:  # it fits: evaluated only if among the best
                    res = self._above(where, best[0])
                    out[where] = res or True
                else:
                    out[where] = res = evaluate_layout(
                        req, self.layouts[where], skip_unfit=True, base=self.base
                    )
                if res and res.ok:
                    heapq.heappush(best, res.best.tokens_per_s_per_gpu)
                    if len(best) > top:
                        heapq.heappop(best)


def _specs(
    req: PlanRequest, layout: ParallelDims, base: Settings, tiled: bool
) -> list[tuple[Settings, list[Variant]]]:
    """``_group_specs`` of the layout's options of one tiling."""
    reasons: dict[str, list[str]] = {"global_batch": [], "pp_microbatches": []}
    return _group_specs(req, layout, base.but(tiled_mlp=tiled), {}, reasons)


def _resident(model: ModelSpec, layout: ParallelDims, s: Settings, hw: Hardware) -> float:
    """The most resident bytes of a rank ``estimate`` models (``resident_bytes``)."""
    return max(resident_bytes(part, layout, rs, hw) for part, rs in _ranks(model, layout, s))


def _some_option_fits(
    req: PlanRequest, layout: ParallelDims, specs: list[tuple[Settings, list[Variant]]]
) -> bool:
    """Whether, of the options of ``specs`` (one tiling's groups), the one that needs the least
    memory as far as its settings tell (the smallest micro-batch, the most recompute, offloaded,
    resharded) fits the device and the host: then the layout fits. False says nothing (memory is
    not monotone in every setting)."""
    return _fits(req, layout, _leanest(specs))


def _leanest(specs: list[tuple[Settings, list[Variant]]]) -> Settings:
    """``_some_option_fits``'s option: the same for every layout of a class (``_class_key``)."""
    lean = (_members(c, [min(v, key=lambda x: (x[0], not x[1], not x[2]))])[0] for c, v in specs)
    return min(lean, key=_leanness)


def _fits(req: PlanRequest, layout: ParallelDims, s: Settings) -> bool:
    """Whether option ``s`` of ``layout`` fits the device and the host."""
    hw = req.hardware
    ranks = memory_cut(req.model, layout, s, hw, hw.mem_bytes)
    mem = pipeline_memory(req.model, layout, s, hw, ranks)
    # the host asked for the rank offloading the most, as ``estimate_pipeline`` asks it
    host = max(rank[4].host_offload for rank in ranks)
    return mem.total <= hw.mem_bytes and not _host_problem(req, layout, host)


def _leanness(s: Settings) -> tuple:
    kept = (
        s.activation_checkpointing,
        s.ac_policy == "full",
        s.activation_offloading,
        s.reshard_after_forward,
    )
    return (s.micro_batch_size, *(not x for x in kept), s.unsharded_grad_accumulation)
