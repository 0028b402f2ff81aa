"""What lets the search skip an option without costing it, each a guarantee of the estimate, never a
guess: the search's answer is the exhaustive one's (``tests/test_plan_search_space.py`` compares
them; docs/planner.md, *Search size*).

* ``step_floor``: the step takes at least its micro-batches' compute (a pipeline's bubble on top):
  tokens/s at most ``tokens / step_floor``. An option whose bound is below the layout's best so far
  cannot win; options are tried in the order of their bounds, the best first.
* ``resident_bytes`` (``plan/memory/peak.py``): parameters, optimizer states and the runtime's own
  memory, held at every moment whatever the activations: above the device, the option cannot fit.
* ``dominators``: options that are at least as fast — the same without offloading (offloading adds
  copy time and nothing else), and, where FSDP reshards after every backward, the same without
  resharding after forward (fewer all-gathers and copies, the same compute). Where one of them fits,
  the option is not tried.
"""

from __future__ import annotations

from ndparallel.layout.dims import ParallelDims
from ndparallel.plan.hardware import Hardware
from ndparallel.plan.memo import Memo
from ndparallel.plan.models import ModelSpec
from ndparallel.plan.pipeline.pipeline_estimate import pp_rank
from ndparallel.plan.pipeline.schedule_model import bubble_fraction, fill_stretch, measured_ranks
from ndparallel.plan.search.estimate import exposed_tp_seconds
from ndparallel.plan.settings import Settings
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
    β/(1−β)·stretch) of any rank, work >= its compute and TP). Memoised on what it reads: the
    model, a dense model's (pp, cp, tp) — not its data-parallel degrees —, the micro-batch's
    settings, the accumulation steps and the schedule."""
    dims = layout if model.is_moe else (layout.pp, layout.cp, layout.tp)
    key = (model, dims, micro_batch_key(s), s.gradient_accumulation_steps, s.pipeline_schedule)
    return _FLOORS.get(
        (*key, s.pipeline_virtual_stages, hw, id(hw), gpus_per_node),
        lambda: _step_floor(model, layout, s, hw, gpus_per_node),
    )


_FLOORS = Memo(65536)


def _step_floor(
    model: ModelSpec, layout: ParallelDims, s: Settings, hw: Hardware, gpus_per_node: int
) -> float:
    ga = s.gradient_accumulation_steps
    if layout.pp == 1:
        return ga * micro_batch_time(model, layout, s, hw).total + exposed_tp_seconds(
            model, layout, s, hw, gpus_per_node
        )
    p, v, name = layout.pp, s.pipeline_virtual_stages, s.pipeline_schedule
    beta = bubble_fraction(name, p, ga, v)
    floor = 0.0
    for rank in measured_ranks(p, name):
        shape, part, rs = pp_rank(model, layout, s, rank)
        work = ga * micro_batch_time(part, layout, rs, hw).total
        work += exposed_tp_seconds(part, layout, rs, hw, gpus_per_node)
        floor = max(floor, work * (1 + beta / (1 - beta) * fill_stretch(model, p, v, name, shape)))
    return floor


def tokens_per_s_bound(
    model: ModelSpec, layout: ParallelDims, s: Settings, hw: Hardware, gpus_per_node: int
) -> float:
    """Tokens/s per GPU the option reaches at most (``step_floor``)."""
    tokens = s.micro_batch_size * s.gradient_accumulation_steps * layout.dp * s.sequence_len
    return tokens / (step_floor(model, layout, s, hw, gpus_per_node) * layout.world)
