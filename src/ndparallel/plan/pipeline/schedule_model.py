"""Pipeline parallel in the planner: what each pp rank holds, the schedules' bubble and in-flight
micro-batches, and the stage-to-stage transfers (docs/planner.md, *Pipeline parallel*).

``p`` stages' worth of pp ranks, ``m`` pipeline micro-batches per step (the runtime's default: one
per gradient-accumulation micro-batch), ``v`` stages per rank. The layers are split as the
runtime splits them (``parallel/pp/split.py``: even, the first stages one layer more).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import lru_cache

from ndparallel.parallel.options import PipelineOptions
from ndparallel.parallel.pp.split import (
    MULTI_STAGE_SCHEDULES,
    ZERO_BUBBLE_SCHEDULES,
    StagePlan,
    pipeline_problem,
    schedule_name,
    stage_layers,
)
from ndparallel.plan.hardware import GiB
from ndparallel.plan.models import ModelSpec

AUTO_SCHEDULES = (("1F1B", 1), ("Interleaved1F1B", 2))
"""(schedule, stages per rank) the search tries for a pp layout (``--pipeline-schedule auto``);
the interleaved one where every stage still gets a layer."""


def default_virtual(schedule: str) -> int:
    """The runtime's stages per rank: 1 for GPipe / 1F1B, 2 for the others."""
    return 2 if schedule in MULTI_STAGE_SCHEDULES else 1


@lru_cache(maxsize=4096)
def problem(schedule: str, pp: int, v: int, layers: int, m: int) -> str | None:
    """Why the runtime would refuse this pipeline (one line), or None (``pipeline_problem``;
    cached: the search asks it for every layout with the same degrees)."""
    return pipeline_problem(PipelineOptions(schedule=schedule, virtual_stages=v), pp, layers, m)


def bubble_fraction(schedule: str, p: int, m: int, v: int = 1) -> float:
    """Share of a step the pipeline idles: GPipe and 1F1B (p−1)/(m+p−1) (Huang et al. 2019,
    Narayanan et al. 2021 §2.2.1); interleaved 1F1B (p−1)/(v·m+p−1) (Narayanan et al. 2021
    §2.2.2: the bubble shrinks by v); the zero-bubble schedules 0 (Qi et al. 2024: the
    weight-gradient passes fill it; their small remainder is not modelled)."""
    if p <= 1 or schedule in ZERO_BUBBLE_SCHEDULES:
        return 0.0
    v = v if schedule in MULTI_STAGE_SCHEDULES else 1
    return (p - 1) / (v * m + p - 1)


def in_flight(schedule: str, p: int, m: int, v: int, rank: int) -> float:
    """Micro-batches whose activations pp rank ``rank`` holds at its peak, in units of one
    micro-batch through all of the rank's layers (each chunk of an interleaved rank is 1/v).

    * GPipe: all m forwards before the first backward.
    * 1F1B: p − rank (torch's ``Schedule1F1B`` warms up with p − rank forwards, then runs one
      forward per backward).
    * Interleaved 1F1B: (v−1)·r + 2·(p−1−rank) + 1 chunks, r = micro-batches per round (p when p
      divides m): torch's ``_get_warmup_ops`` plus the steady state's one, and Megatron-LM's
      ``num_warmup_microbatches`` of its interleaved schedule; for rank 0 that is
      (1 + (p−1)/(p·v))·p of the rank's micro-batches (Korthikanti et al. 2022, §4.2.3).
    * Interleaved zero bubble: the same with one warm-up chunk per hop (torch's multiply_factor 1);
      the weight-gradient inputs kept past the input backward are not counted.
    * ZBV zero bubble: 2p chunks (torch's warm-up: 2(p−rank)−1 + 2·rank + 1) = p on every rank,
      1F1B's first-stage peak (Qi et al. 2024).
    """
    if p <= 1:
        return 1.0
    if schedule == "GPipe":
        return float(m)
    if schedule == "1F1B":
        return float(min(m, p - rank))
    if schedule == "ZBVZeroBubble":
        return float(min(m, p))
    per_round = m // max(1, m // p)
    hops = 2 if schedule == "Interleaved1F1B" else 1
    chunks = (v - 1) * per_round + hops * (p - 1 - rank) + 1
    return min(chunks, m * v) / v


@dataclass(frozen=True)
class RankShape:
    """What one pp rank runs: its decoder layers (all its stages), whether it holds the first
    stage (the embedding) and the last (final norm, LM head, loss), and its stage count."""

    rank: int
    layers: int
    first: bool
    last: bool
    stages: int


@lru_cache(maxsize=1024)
def _stage_plan(model: ModelSpec, p: int, v: int, schedule: str) -> StagePlan:
    """The runtime's split (``parallel/pp/split.stage_layers``)."""
    return StagePlan(
        p,
        v,
        schedule,
        stage_layers(PipelineOptions(schedule=schedule, virtual_stages=v), p * v, model.layers),
    )


@lru_cache(maxsize=1024)
@lru_cache(maxsize=4096)
def rank_shape(model: ModelSpec, p: int, v: int, schedule: str, rank: int) -> RankShape:
    """What pp rank ``rank`` runs under the runtime's split (``StagePlan.stages_of``)."""
    plan = _stage_plan(model, p, v, schedule)
    mine = plan.stages_of(rank)
    return RankShape(rank, sum(len(plan.layers[s]) for s in mine), 0 in mine, p * v - 1 in mine, len(mine))


@lru_cache(maxsize=1024)
def fill_stretch(model: ModelSpec, p: int, v: int, schedule: str, shape: RankShape) -> float:
    """How much longer the fill and the drain are than the bubble formula's p − 1 chunks of the
    pacing rank's average chunk (its layers / its stages): they pass through the first p stages,
    one per rank, which hold more layers than that average when the split is uneven (126 layers
    in 112 stages: 14 of 2 layers first, then 98 of 1). The mean of those stages over the average."""
    plan = _stage_plan(model, p, v, schedule)
    first_row = sum(len(plan.layers[s]) for s in range(p)) / p
    return first_row / (shape.layers / shape.stages)


def first_rank_model(model: ModelSpec, layout, s) -> ModelSpec:
    """The part of ``model`` the first pp rank holds under ``s``'s schedule (the whole model
    without pipeline parallel): the rank with the most layers and micro-batches in flight."""
    if layout.pp <= 1:
        return model
    return rank_model(model, rank_shape(model, layout.pp, s.pipeline_virtual_stages, s.pipeline_schedule, 0))


def rank_model(model: ModelSpec, shape: RankShape) -> ModelSpec:
    """The part of ``model`` a pp rank holds, as a model: its layers, the embedding on the first
    stage, final norm + LM head on the last (tied embeddings: two copies, one each end). One
    object per distinct part (ranks of different shapes may hold equal parts): the planner's
    caches find it by identity."""
    return _part(model, shape.layers, shape.first, shape.last)


@lru_cache(maxsize=1024)
def _part(model: ModelSpec, layers: int, first: bool, last: bool) -> ModelSpec:
    return replace(model, layers=layers, tied_embeddings=False, has_embedding=first, has_lm_head=last)


def measured_ranks(p: int, schedule: str) -> tuple[int, ...]:
    """The pp ranks worth modelling: the first (most layers, the most micro-batches in flight,
    the embedding) and the last (LM head and loss); every other rank is below the first in both
    memory and time. ZBV's rank 0 holds both ends."""
    return (0,) if schedule == "ZBVZeroBubble" else (0, p - 1)


def stage_inputs_held(model: ModelSpec, layout, s) -> int:
    """Received stage inputs (hidden states) a pp rank holds per micro-batch in flight (the unit
    of ``in_flight``): torch's ``PipelineStage`` keeps each chunk's inputs in its
    forward cache until the chunk's backward, one per stage of the rank but the first stage's
    (token ids). Without offloading the first layer's saved input is that tensor; offloaded, its
    host copy does not free it."""
    if layout.pp <= 1:
        return 0
    return rank_stages(layout, s) - (1 if model.has_embedding else 0)


def stage_outputs_held(model: ModelSpec, layout, s) -> int:
    """Stage outputs (hidden states) a pp rank holds per micro-batch in flight: the forward cache
    keeps each chunk's output until its backward (the autograd root), one per stage of the rank but
    the model's last (its output is the loss). No layer of the chunk saves it, with or without
    offloading. Measured: ``bench/simulate_meta_405b.py`` (docs/simulate.md)."""
    if layout.pp <= 1:
        return 0
    return rank_stages(layout, s) - (1 if model.has_lm_head else 0)


def rank_stages(layout, s) -> int:
    """Stages a rank runs, each its own forward per micro-batch: ``pp_virtual`` under pipeline
    parallel, else the one model."""
    return s.pipeline_virtual_stages if layout.pp > 1 else 1


# ------------------------------------------------------------------- transfers
def p2p_bytes(model: ModelSpec, layout, s) -> int:
    """One stage boundary's transfer per micro-batch: the hidden states, micro_batch × seq/cp ×
    hidden in the activation dtype, ÷ tp under sequence parallel (a sequence-sharded DTensor)."""
    per = s.micro_batch_size * s.sequence_len // layout.cp * model.hidden * s.act_bytes
    return per // layout.tp if s.sequence_parallel and layout.tp > 1 else per


def p2p_collectives(model: ModelSpec, layout, s, shape: RankShape, collective) -> list:
    """The rank's sends per step: activations forward from each of its stages but the model's
    last, their gradients backward from each but the first (one ``send_recv`` each). Cached:
    asked for every option of every pp layout, each time the same few."""
    return list(
        _p2p_collectives(p2p_bytes(model, layout, s), s.gradient_accumulation_steps, shape, collective)
    )


@lru_cache(maxsize=4096)
def _p2p_collectives(nbytes: int, m: int, shape: RankShape, collective) -> tuple:
    return tuple(
        c
        for c in (
            collective(
                "send_recv",
                "pp",
                nbytes,
                m * (shape.stages - shape.last),
                "PP activations to the next stage (fwd)",
                "pipeline",
            ),
            collective(
                "send_recv",
                "pp",
                nbytes,
                m * (shape.stages - shape.first),
                "PP activation gradients to the previous stage (bwd)",
                "pipeline",
            ),
        )
        if c.count > 0
    )


def exposed_transfers(schedule: str, p: int, m: int, v: int) -> int:
    """Transfers on a step's critical path (an assumption, docs/planner.md). torch's single-stage
    schedules (GPipe, 1F1B) wait for each micro-batch's send and receive before computing on
    (``_wait_batch_p2p`` in their loop): one forward and one backward transfer per micro-batch,
    plus the fill and drain, 2·(m + p − 1). The multi-stage ones post their receives ahead and
    their sends asynchronously (``_PipelineScheduleRuntime``): only the first micro-batch's chain
    through every boundary and back, 2·(p·v − 1)."""
    if schedule in MULTI_STAGE_SCHEDULES:
        return 2 * (p * v - 1)
    return 2 * (m + p - 1)


@dataclass
class PipelineInfo:
    """What ``--explain`` says of a pp layout."""

    schedule: str
    virtual: int
    microbatches: int
    bubble_fraction: float
    """The schedule's idle share (``bubble_fraction``)."""
    ranks: dict = field(default_factory=dict)
    """'first' / 'last' -> (RankShape, MemoryBreakdown, busy seconds per step)."""
    worst: str = "first"
    """The rank whose memory is reported (the larger)."""
    pace: str = "first"
    """The slowest rank (it sets the pipeline's pace)."""
    stretch: float = 1.0
    """The fill and drain over the formula's (``fill_stretch``)."""

    def to_dict(self) -> dict:

        return {
            "schedule": self.schedule,
            "virtual_stages": self.virtual,
            "microbatches": self.microbatches,
            "bubble_fraction": self.bubble_fraction,
            "fill_stretch": self.stretch,
            "worst_memory": self.worst,
            "pace": self.pace,
            "ranks": {
                k: {
                    "layers": shape.layers,
                    "embedding": shape.first,
                    "lm_head": shape.last,
                    "memory_gib": mem.total / GiB,
                    "busy_s": busy,
                }
                for k, (shape, mem, busy) in self.ranks.items()
            },
        }


def canonical(schedule: str) -> str:
    """The runtime's spelling of ``schedule``; ValueError naming the choices otherwise."""
    name = schedule_name(schedule)
    if name is None:
        raise ValueError(
            f"{schedule!r} is not a pipeline schedule: use GPipe, 1F1B, Interleaved1F1B, "
            "InterleavedZeroBubble or ZBVZeroBubble"
        )
    return name


def pipeline_lines(e, device_short: bool = True) -> list[str]:
    """``--explain``'s lines of a pp layout's estimate ``e``: the bubble share (and how gradients
    are reduced) in one, the first and the last stage's memory in the other; when it does not
    fit the device (``device_short``: not only the host's memory), a third saying why."""

    info, t = e.pipeline, e.time
    per_rank = f" × {info.virtual} per rank" if info.virtual > 1 else ""
    grads = (
        "FSDP gradients reduced once per step (unsharded_grad_accumulation)"
        if e.settings.unsharded_grad_accumulation
        else "FSDP gradients reduced every micro-batch"
    )
    stretch = f" × {info.stretch:.2f} (uneven stages)" if abs(info.stretch - 1) > 0.02 else ""
    lines = [
        f"Pipeline {info.schedule} ({e.layout.pp} stages{per_rank}, {info.microbatches} micro-batches): "
        f"bubble {info.bubble_fraction:.1%} of the pipeline{stretch} = {t.pp_bubble:.2f} s "
        f"({t.pp_bubble / t.step:.1%} "
        f"of the step); p2p exposed {t.pp_exposed:.2f} s; pace: {info.pace} stage; {grads}"
    ]
    parts = []
    for name, (shape, mem, _) in info.ranks.items():
        ends = (" + embedding" if shape.first else "") + (" + head, loss" if shape.last else "")
        parts.append(f"{name} ({shape.layers} layers{ends}) {mem.total / GiB:.1f} GiB")
    lines.append("Stage memory: " + ", ".join(parts) + f"; reported: {info.worst}")
    if not e.fits and device_short:
        lines.append(_why_not(e))
    return lines


def _why_not(e) -> str:
    """One line: the reported stage's memory and its activations' share, factor by factor."""

    info, s = e.pipeline, e.settings
    shape, mem, _ = info.ranks[info.worst]
    tokens = s.micro_batch_size * s.sequence_len // e.layout.cp
    held = in_flight(
        s.pipeline_schedule, e.layout.pp, s.gradient_accumulation_steps, s.pipeline_virtual_stages, shape.rank
    )
    kept = (
        "each layer's input (checkpointing)"
        if s.recompute in ("full", "op")
        else f"{mem.activation_bytes_per_layer / tokens / 1e3:.0f} KB per token and layer (no checkpointing)"
    )
    if s.recompute == "selective":
        kept = "each layer's norm and block inputs, q, k, v, attention output, gate, up (selective AC)"
    if s.recompute == "selective" and mem.host_offload:
        kept = "each layer's down_proj output and each stage's input (selective AC, the rest offloaded)"
    return (
        f"Does not fit: the {info.worst} stage needs {mem.total / GiB:.1f} GiB, "
        f"{mem.activations / GiB:.1f} of them activations: {held:.1f} micro-batches of {tokens} tokens in "
        f"flight "
        f"through its {shape.layers} layers, {kept}"
    )
