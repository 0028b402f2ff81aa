"""What lets the search skip an option without costing it, each a guarantee of the estimate, never a
guess: the search's answer is the exhaustive one's (``tests/test_plan_search_space.py`` compares
them; docs/planner.md, *Search size*).

* ``step_floor``: the step takes at least its micro-batches' compute (a pipeline's bubble on top):
  tokens/s at most ``tokens / step_floor``. An option whose bound is below the layout's best so far
  cannot win; options are tried in the order of their bounds, the best first.
* ``relaxed_bound``: ``step_floor``'s bound without checkpointing, at least every policy's: the
  table's search (``evaluation._top``) bounds a step's policies by it before computing theirs.
* ``option_floor``: the same floor with the option's own exposed FSDP traffic on top (its gathers
  and reductions no compute hides: ``estimate.fsdp_exposed``), which resharding and gradient
  accumulation change; the search computes it for a group only when the group's ``step_floor``
  would have it costed next, and skips an option whose own bound is below the best so far.
* ``resident_bytes`` (``plan/memory/peak.py``): parameters, optimizer states and the runtime's own
  memory, held at every moment whatever the activations, and the gradients the end of backward
  holds: above the device, the option cannot fit.
* ``dominators``: options that are at least as fast — the same without offloading (offloading adds
  copy time and nothing else), and, where FSDP reshards after every backward, the same without
  resharding after forward (fewer all-gathers and copies, the same compute). Where one of them fits,
  the option is not tried.
"""

from __future__ import annotations

from operator import attrgetter

from ndparallel.layout.dims import ParallelDims
from ndparallel.plan.hardware import Hardware
from ndparallel.plan.memo import Memo
from ndparallel.plan.models import ModelSpec, fsdp_units
from ndparallel.plan.pipeline.pipeline_estimate import pp_rank
from ndparallel.plan.pipeline.schedule_model import bubble_fraction, fill_stretch, measured_ranks
from ndparallel.plan.search.estimate import exposed_tp_seconds, exposure, fsdp_exposed
from ndparallel.plan.settings import COLLECTIVE_FIELDS, Settings
from ndparallel.plan.time import comms, links
from ndparallel.plan.time.compute import micro_batch_key, micro_batch_time

ROUNDING = 1e-9
"""The relative slack a bound keeps against the estimate's own rounding (the floor and the step sum
the same terms in another order)."""
OptionKey = tuple
"""An option by its searched settings (``option_key``): what ``dominators`` and the search's set of
options that fit compare."""


def option_key(s: Settings) -> OptionKey:
    return (
        s.micro_batch_size,
        s.pipeline_schedule,
        s.pipeline_virtual_stages,
        s.unsharded_grad_accumulation,
        s.tiled_mlp,
        s.activation_checkpointing,
        s.ac_policy,
        s.activation_offloading,
        s.reshard_after_forward,
    )


def dominators(layout: ParallelDims, s: Settings) -> list[OptionKey]:
    """Options at least as fast as ``s`` (same memory or more) by the estimate's own terms: ``s``
    without offloading; where every backward reshards (no pipeline stage keeping its parameters
    gathered, ``unsharded_grad_accumulation`` off or no pp), ``s`` without resharding after forward,
    and both. An option that is not searched is never in the set of those that fit."""
    out = []
    if s.activation_offloading:
        out.append(option_key(s.but(activation_offloading=False)))
    if s.reshard_after_forward and (layout.pp == 1 or not s.unsharded_grad_accumulation):
        kept = s.but(reshard_after_forward=False)
        out.append(option_key(kept))
        if s.activation_offloading:
            out.append(option_key(kept.but(activation_offloading=False)))
    return out


def step_floor(
    model: ModelSpec, layout: ParallelDims, s: Settings, hw: Hardware, gpus_per_node: int
) -> float:
    """Seconds the option's step takes at least: its micro-batches' compute (``micro_batch_time``)
    and TP's collectives, which nothing hides (``estimate.rank_step``; FSDP's traffic and copies,
    CP's, the optimizer and offloading only add); under pipeline parallel, each modelled rank's
    with the bubble the schedule adds on it (``pipeline_estimate``: step >= work·(1 +
    β/(1−β)·stretch) of any rank, work >= its compute and TP)."""
    return max(paced for paced, *_ in rank_floors(model, layout, s, hw, gpus_per_node))


RankFloor = tuple
"""(paced seconds, micro-batch seconds, part of the model, FSDP roots) of one modelled rank: its
micro-batches' compute and TP (with a pipeline's bubble on top), one micro-batch's compute, what
it holds and the FSDP units one of its roots gathers one after another (``estimate.rank_step``)."""


def rank_floors(
    model: ModelSpec, layout: ParallelDims, s: Settings, hw: Hardware, gpus_per_node: int
) -> tuple[RankFloor, ...]:
    """``step_floor``'s terms per modelled rank. Memoised on what they read: the model, a dense
    model's (pp, cp, tp) — not its data-parallel degrees —, the micro-batch's settings, the
    accumulation steps and the schedule."""
    dims = layout if model.is_moe else (layout.pp, layout.cp, layout.tp)
    key = (model, dims, micro_batch_key(s), s.gradient_accumulation_steps, s.pipeline_schedule)
    return _FLOORS.get(
        (*key, s.pipeline_virtual_stages, hw, id(hw), gpus_per_node),
        lambda: _rank_floors(model, layout, s, hw, gpus_per_node),
    )


_FLOORS = Memo(65536)


def _rank_floors(
    model: ModelSpec, layout: ParallelDims, s: Settings, hw: Hardware, gpus_per_node: int
) -> tuple[RankFloor, ...]:
    ga = s.gradient_accumulation_steps
    units = sum(count for count, _ in fsdp_units(model).values())
    if layout.pp == 1:
        t_mb = micro_batch_time(model, layout, s, hw).total
        return ((ga * t_mb + exposed_tp_seconds(model, layout, s, hw, gpus_per_node), t_mb, model, units),)
    p, v, name = layout.pp, s.pipeline_virtual_stages, s.pipeline_schedule
    beta = bubble_fraction(name, p, ga, v)
    out = []
    for rank in measured_ranks(p, name):
        shape, part, rs = pp_rank(model, layout, s, rank)
        t_mb = micro_batch_time(part, layout, rs, hw).total
        work = ga * t_mb + exposed_tp_seconds(part, layout, rs, hw, gpus_per_node)
        stretch = fill_stretch(model, p, v, name, shape)
        roots = sum(count for count, _ in fsdp_units(part).values()) / v
        out.append((work * (1 + beta / (1 - beta) * stretch), t_mb, part, roots))
    return tuple(out)


def tokens_per_s_bound(
    model: ModelSpec, layout: ParallelDims, s: Settings, hw: Hardware, gpus_per_node: int
) -> float:
    """Tokens/s per GPU the option reaches at most (``step_floor``)."""
    return _per_gpu(layout, s, step_floor(model, layout, s, hw, gpus_per_node))


def relaxed_bound(
    model: ModelSpec, layout: ParallelDims, s: Settings, hw: Hardware, gpus_per_node: int
) -> float:
    """``tokens_per_s_bound`` of ``s`` without checkpointing (nor offloading, which needs it): at
    least that of every checkpointing policy of the same step, recompute only adding compute and
    TP collectives (``tests/test_plan_search_space.py`` checks it on every option it costs)."""
    off = s.but(activation_checkpointing=False, ac_policy="full", activation_offloading=False)
    return tokens_per_s_bound(model, layout, off, hw, gpus_per_node)


def _per_gpu(layout: ParallelDims, s: Settings, seconds: float) -> float:
    """Tokens/s per GPU of a step of ``seconds`` (the global batch over the world)."""
    tokens = s.micro_batch_size * s.gradient_accumulation_steps * layout.dp * s.sequence_len
    return tokens / (seconds * layout.world)


def option_floor(
    model: ModelSpec,
    layout: ParallelDims,
    s: Settings,
    hw: Hardware,
    gpus_per_node: int,
    floors: tuple[RankFloor, ...] | None = None,
) -> float:
    """``step_floor`` with the option's own exposed FSDP traffic on each modelled rank
    (``estimate.fsdp_exposed``), which the step adds (without pipeline parallel) or its rank's work
    and once-per-step part carry (``pipeline_estimate``: step >= work·(1 + β/(1−β)·stretch) + once
    of any rank, work + once >= its compute, TP and FSDP exposure, β/(1−β)·stretch >= 0).
    ``floors``: ``rank_floors`` of an option of its group (the same: gradient reduction,
    resharding and offloading change none of them)."""
    floor = 0.0
    rs = s
    if layout.pp > 1:  # pipeline_estimate.rank_settings' FSDP fields
        per_step = s.unsharded_grad_accumulation
        rs = s.but(sync_every_microbatch=not per_step, reshard_after_backward=not per_step)
    for paced, t_mb, part, roots in floors or rank_floors(model, layout, s, hw, gpus_per_node):
        gather, reduce = fsdp_traffic(part, layout, rs, hw, gpus_per_node)
        floor = max(floor, paced + fsdp_exposed(gather, reduce, roots, rs, t_mb))
    return floor


def fsdp_traffic(
    model: ModelSpec, layout: ParallelDims, s: Settings, hw: Hardware, gpus_per_node: int
) -> tuple[float, float]:
    """Seconds of a rank's FSDP all-gathers and gradient reductions in one step, before overlap
    (``estimate.rank_step``'s ``gather`` and ``reduce``: the collectives FSDP overlaps with
    compute, ``comms.data_parallel``'s, as LoRA and NF4 adapt them). Memoised on what those read:
    the model, the layout, the data-parallel settings (``COLLECTIVE_FIELDS``) and LoRA's and
    NF4's."""
    key = (model, layout, DP_FIELDS(s), s.lora_r, s.lora_saved, s.load_in_4bit, hw, id(hw), gpus_per_node)
    return _TRAFFIC.get(key, lambda: _fsdp_traffic(model, layout, s, hw, gpus_per_node))


DP_FIELDS = attrgetter(*COLLECTIVE_FIELDS["data_parallel"])
_TRAFFIC = Memo(65536)


def _fsdp_traffic(
    model: ModelSpec, layout: ParallelDims, s: Settings, hw: Hardware, gpus_per_node: int
) -> tuple[float, float]:
    costs = links.cost_table(layout, hw, gpus_per_node)
    gather = reduce = 0.0
    if s.lora_r or s.load_in_4bit:
        for c in comms.collectives_for(model, layout, s):
            kind = exposure(c)
            if kind == "gather":
                gather += costs[c][0]
            elif kind == "reduce":
                reduce += costs[c][0]
        return gather, reduce
    # comms.data_parallel's collectives (all overlapped with compute), each call's seconds once
    # per layout: ``calls * seconds`` is the cost table's ``c.count * collective_time`` exactly
    key = (model, layout, s.mixed_precision, hw, id(hw), gpus_per_node)
    for kind, count, reshards, seconds in _CALLS.get(key, lambda: _call_seconds(model, layout, s, costs)):
        if kind == "all_gather":
            gather += comms.calls_per_step(kind, count, reshards, s) * seconds
        else:
            reduce += comms.calls_per_step(kind, count, reshards, s) * seconds
    return gather, reduce


_CALLS = Memo(16384)


def _call_seconds(model: ModelSpec, layout: ParallelDims, s: Settings, costs: dict) -> tuple:
    """(kind, units, reshards, seconds of one call) of each of ``comms.data_parallel_calls``."""
    return tuple(
        (kind, count, reshards, costs[comms.Collective(kind, dim, nbytes, 1, what, "compute")][0])
        for kind, dim, nbytes, what, count, reshards in comms.data_parallel_calls(model, layout, s)
    )


def option_bound(
    model: ModelSpec,
    layout: ParallelDims,
    s: Settings,
    hw: Hardware,
    gpus_per_node: int,
    floors: tuple[RankFloor, ...] | None = None,
) -> float:
    """Tokens/s per GPU the option reaches at most (``option_floor``)."""
    return _per_gpu(layout, s, option_floor(model, layout, s, hw, gpus_per_node, floors))
