"""Which decoder layers each pipeline stage runs, which stages each pp rank holds, and what a
pipeline layout cannot do — pure arithmetic, checked before any rank starts (``preflight``) and
again where the stages are built.

Stage ``s`` of ``pp × virtual`` stages lives on pp rank ``s % pp`` (the loop order of torch's
interleaved schedules), except under 'ZBVZeroBubble', whose two stages per rank form a V: rank
``r`` holds stages ``r`` and ``2·pp − 1 − r`` (the first and the last stage share rank 0).
"""

from __future__ import annotations

from dataclasses import dataclass

from ndparallel.parallel.options import PipelineOptions

SINGLE_STAGE_SCHEDULES = ("GPipe", "1F1B")
MULTI_STAGE_SCHEDULES = ("Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble")
SCHEDULES = (*SINGLE_STAGE_SCHEDULES, *MULTI_STAGE_SCHEDULES)
ZERO_BUBBLE_SCHEDULES = ("InterleavedZeroBubble", "ZBVZeroBubble")
"""Schedules that split a backward into input- and weight-gradient passes."""


@dataclass(frozen=True)
class StagePlan:
    """The resolved split: ``layers[s]`` are the decoder-layer indices of stage ``s``."""

    pp: int
    virtual: int
    schedule: str
    layers: tuple[tuple[int, ...], ...]

    @property
    def n_stages(self) -> int:
        return self.pp * self.virtual

    def rank_of(self, stage: int) -> int:
        """The pp rank that runs ``stage``."""
        if self.schedule == "ZBVZeroBubble":
            return stage if stage < self.pp else 2 * self.pp - 1 - stage
        return stage % self.pp

    def stages_of(self, pp_rank: int) -> list[int]:
        """The stages ``pp_rank`` runs, in increasing order."""
        return [s for s in range(self.n_stages) if self.rank_of(s) == pp_rank]


def schedule_name(name: str) -> str | None:
    """The canonical spelling of a schedule name (case-insensitive), or None."""
    return next((s for s in SCHEDULES if s.lower() == str(name).lower()), None)


def virtual_stages(options: PipelineOptions) -> int:
    schedule = schedule_name(options.schedule) or options.schedule
    if options.virtual_stages is not None:
        return options.virtual_stages
    return 2 if schedule in MULTI_STAGE_SCHEDULES else 1


def pipeline_problem(
    options: PipelineOptions, pp: int, num_layers: int | None, microbatches: int | None
) -> str | None:
    """Why this pipeline cannot run (one line naming the field and the fix), or None.
    ``num_layers``: the model's decoder layers (None: unknown yet); ``microbatches``: the
    pipeline micro-batches of one step (None: unknown yet)."""
    schedule = schedule_name(options.schedule)
    if schedule is None:
        return f"pipeline_schedule={options.schedule!r} is not a schedule: use one of {list(SCHEDULES)}"
    if pp <= 1:
        return None
    v = virtual_stages(options)
    if v < 1:
        return f"pipeline_virtual_stages={v}: give 1 or more stages per rank"
    if schedule in SINGLE_STAGE_SCHEDULES and v != 1:
        return (
            f"pipeline_schedule={schedule!r} runs one stage per rank, but pipeline_virtual_stages={v}: "
            f"use {MULTI_STAGE_SCHEDULES[0]!r} for several stages per rank, or pipeline_virtual_stages: 1"
        )
    if schedule in MULTI_STAGE_SCHEDULES and v < 2:
        return (
            f"pipeline_schedule={schedule!r} needs 2 or more stages per rank (pipeline_virtual_stages), got "
            f"{v}; "
            "use '1F1B' for one stage per rank"
        )
    if schedule == "ZBVZeroBubble" and v != 2:
        return (
            f"pipeline_schedule='ZBVZeroBubble' runs exactly 2 stages per rank, got "
            f"pipeline_virtual_stages={v}"
        )
    stages = pp * v
    if num_layers is not None:
        if stages > num_layers:
            return (
                f"pipeline_parallel_size={pp} × {v} stage(s) per rank = {stages} stages, but the model has "
                f"{num_layers} decoder layers: every stage needs one; use at most {num_layers} stages"
            )
        try:
            stage_layers(options, stages, num_layers)
        except ValueError as e:
            return str(e)
    if microbatches is not None:
        if microbatches < pp:
            return (
                f"{microbatches} pipeline micro-batch(es) per step for {pp} pipeline stages: every stage "
                f"would idle; set pipeline_microbatches (or gradient_accumulation_steps) to at least {pp}"
            )
        if schedule in MULTI_STAGE_SCHEDULES[:2] and microbatches % pp:
            return (
                f"pipeline_schedule={schedule!r} needs the micro-batches per step ({microbatches}) to be a "
                f"multiple of pipeline_parallel_size={pp}: use {microbatches + pp - microbatches % pp}"
            )
    return None


def stage_layers(options: PipelineOptions, n_stages: int, num_layers: int) -> tuple[tuple[int, ...], ...]:
    """The decoder-layer indices of each stage: the split points, else ``layers_per_stage``
    layers each, else an even split (the first stages take one more when it does not divide)."""
    if options.split_points is not None and options.layers_per_stage is not None:
        raise ValueError("pipeline_split_points and pipeline_layers_per_stage exclude each other: give one")
    if options.split_points is not None:
        points = list(options.split_points)
        if (
            len(points) != n_stages - 1
            or points != sorted(set(points))
            or not all(0 < p < num_layers for p in points)
        ):
            raise ValueError(
                f"pipeline_split_points={points}: give {n_stages - 1} increasing layer indices in "
                f"1..{num_layers - 1} (the first layer of every stage but the first)"
            )
        bounds = [0, *points, num_layers]
    elif options.layers_per_stage is not None:
        if options.layers_per_stage * n_stages != num_layers:
            raise ValueError(
                f"pipeline_layers_per_stage={options.layers_per_stage} × {n_stages} stages = "
                f"{options.layers_per_stage * n_stages}, but the model has {num_layers} decoder "
                "layers: make them equal, or leave it unset for an even split"
            )
        bounds = [s * options.layers_per_stage for s in range(n_stages + 1)]
    else:
        base, extra = divmod(num_layers, n_stages)
        bounds = [0]
        for s in range(n_stages):
            bounds.append(bounds[-1] + base + (1 if s < extra else 0))
    return tuple(tuple(range(a, b)) for a, b in zip(bounds, bounds[1:]))


def plan_stages(options: PipelineOptions, pp: int, num_layers: int) -> StagePlan:
    """The ``StagePlan`` of a valid pipeline layout (``pipeline_problem`` raised as ValueError)."""
    problem = pipeline_problem(options, pp, num_layers, None)
    if problem:
        raise ValueError(problem)
    v = virtual_stages(options)
    return StagePlan(pp, v, schedule_name(options.schedule), stage_layers(options, pp * v, num_layers))


def bubble_fraction(plan: StagePlan, microbatches: int) -> float:
    """The share of a step each stage idles in the schedule's fill and drain (the standard
    estimate, equal stage times): (p − 1) / (m + p − 1) for GPipe and 1F1B, (p − 1) / (v·m + p − 1)
    with v stages per rank (interleaved), about 0 for the zero-bubble schedules (their weight-
    gradient passes fill the gaps; ideal, not guaranteed)."""
    p, m, v = plan.pp, microbatches, plan.virtual
    if plan.schedule in ZERO_BUBBLE_SCHEDULES:
        return 0.0
    return (p - 1) / (v * m + p - 1)
