"""A pipeline-parallel layout's estimate: its first and last pp ranks modelled as ranks of their
own (``estimate.rank_step`` on ``pipeline.rank_model``), the slowest setting the pace.

Step = work(slowest rank) / (1 − β) + its once-per-step FSDP exposure + exposed transfers + the
optimizer step, β the schedule's bubble fraction, work = the rank's micro-batches with their
exposed TP/CP communication and, when gradients are reduced on every micro-batch (the runtime's
default), their exposed FSDP traffic. Reported memory: the larger rank's (host memory of offloaded
activations: the larger rank's)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from functools import lru_cache

from ndparallel.layout.dims import ParallelDims
from ndparallel.parallel.pp.split import ZERO_BUBBLE_SCHEDULES
from ndparallel.plan.hardware import Hardware
from ndparallel.plan.memory.activations import host_bytes
from ndparallel.plan.memory.peak import MemoryBreakdown, estimate_memory
from ndparallel.plan.models import ModelSpec
from ndparallel.plan.pipeline.schedule_model import (
    PipelineInfo,
    RankShape,
    bubble_fraction,
    exposed_transfers,
    fill_stretch,
    in_flight,
    measured_ranks,
    p2p_bytes,
    p2p_collectives,
    rank_model,
    rank_shape,
)
from ndparallel.plan.search.estimate import Estimate, finish, rank_step
from ndparallel.plan.settings import Settings
from ndparallel.plan.time import links
from ndparallel.plan.time.comms import Collective


@lru_cache(maxsize=4096)
def _one_send(nbytes: int) -> Collective:
    """One stage-to-stage transfer (one object per size: ``links.cost``'s cache key)."""
    return Collective("send_recv", "pp", nbytes, 1, "")


def rank_settings(s: Settings, p: int, rank: int, last: bool) -> Settings:
    """``s`` for one pp rank: its in-flight micro-batches; gradients reduced on every micro-batch
    (the runtime's default: ``Settings.sync_every_microbatch``) or, with
    ``unsharded_grad_accumulation``, once per step by the stage's FSDP root, which keeps its
    parameters gathered until then (``Settings.reshard_after_backward`` False;
    ``parallel/pp/schedule.py: _shard_root``); on the last stage under a zero-bubble schedule the
    full-logits loss (the runtime's: the chunked loss cannot split its backward)."""
    chunked = s.chunked_loss and not (last and s.pipeline_schedule in ZERO_BUBBLE_SCHEDULES)
    per_step = s.unsharded_grad_accumulation
    return s.but(
        pp_in_flight=in_flight(
            s.pipeline_schedule, p, s.gradient_accumulation_steps, s.pipeline_virtual_stages, rank
        ),
        chunked_loss=chunked,
        sync_every_microbatch=not per_step,
        reshard_after_backward=not per_step,
    )


def pp_rank(
    model: ModelSpec, layout: ParallelDims, s: Settings, rank: int
) -> tuple[RankShape, ModelSpec, Settings]:
    """Pp rank ``rank`` as a rank of its own: what it runs, that part of ``model``, its settings."""
    shape = rank_shape(model, layout.pp, s.pipeline_virtual_stages, s.pipeline_schedule, rank)
    return shape, rank_model(model, shape), rank_settings(s, layout.pp, rank, shape.last)


def busiest_offload(model: ModelSpec, layout: ParallelDims, s: Settings) -> tuple[int, float, float]:
    """(decoder layers, micro-batches in flight, host bytes) of the rank that offloads the most: the
    first pp rank (every rank alike without pipeline parallel)."""
    if layout.pp > 1:
        _, model, s = pp_rank(model, layout, s, 0)
    return model.layers, s.pp_in_flight, host_bytes(model, layout, s)


MeasuredRank = tuple[int, RankShape, ModelSpec, Settings, MemoryBreakdown]
"""(pp rank, its shape, its part of the model, its settings, its memory): ``measured``."""


def measured(model: ModelSpec, layout: ParallelDims, s: Settings, hw: Hardware) -> tuple[MeasuredRank, ...]:
    """The pp ranks ``estimate_pipeline`` models, each with its memory: computed once by the
    search's memory cut and handed on to ``estimate_pipeline`` when the option fits."""
    return tuple(each_measured(model, layout, s, hw))


def each_measured(
    model: ModelSpec, layout: ParallelDims, s: Settings, hw: Hardware
) -> Iterator[MeasuredRank]:
    """``measured``'s ranks one at a time, the first pp rank (the most in flight) first: the search
    stops at one that does not fit."""
    for rank in measured_ranks(layout.pp, s.pipeline_schedule):
        shape, part, rs = pp_rank(model, layout, s, rank)
        yield rank, shape, part, rs, estimate_memory(part, layout, rs, hw)


def pipeline_memory(
    model: ModelSpec, layout: ParallelDims, s: Settings, hw: Hardware, ranks: tuple[MeasuredRank, ...] = ()
) -> MemoryBreakdown:
    """The memory ``estimate_pipeline`` reports (its larger measured rank's), without the step's
    time: the search's first cut (``search.evaluate_layout(skip_unfit=True)``)."""
    return max((r[4] for r in ranks or measured(model, layout, s, hw)), key=lambda m: m.total)


def _paced(timeb, s: Settings) -> tuple[float, float]:
    """(work the pipeline paces, FSDP time outside it): a stage root reducing once per step gathers
    at the first micro-batch and reduces after the last, outside the steady state."""
    once = timeb.dp_exposed if s.unsharded_grad_accumulation else 0.0
    return timeb.busy + timeb.dp_exposed - once, once


def estimate_pipeline(
    model: ModelSpec,
    layout: ParallelDims,
    s: Settings,
    hw: Hardware,
    gpus_per_node: int,
    global_batch: int | None = None,
    measured_: tuple[MeasuredRank, ...] = (),
) -> Estimate:
    """The estimate of a pp layout (``s.pipeline_schedule``, ``s.pipeline_virtual_stages``,
    m = ``s.gradient_accumulation_steps``); ``measured_``: its ``measured`` ranks when the caller has
    them."""
    p, m, v, schedule = (
        layout.pp,
        s.gradient_accumulation_steps,
        s.pipeline_virtual_stages,
        s.pipeline_schedule,
    )
    ranks = {}
    for rank, shape, part, rs, mem in measured_ or measured(model, layout, s, hw):
        mem, colls, timeb = rank_step(part, layout, rs, hw, gpus_per_node, mem)
        colls = colls + p2p_collectives(part, layout, rs, shape, Collective)
        ranks["first" if rank == 0 else "last"] = (shape, mem, colls, timeb)
    # A micro-batch's exposed FSDP traffic (by default every stage gathers and reduces on every
    # micro-batch) is on its rank's critical path like its compute: the slowest rank paces the
    # pipeline; a once-per-step reduction adds after it.
    beta = bubble_fraction(schedule, p, m, v)

    def pipelined(k: str) -> tuple[float, float, float, float]:
        """(work, its bubble, once-per-step FSDP, fill stretch) were rank ``k`` the pace."""
        work, once = _paced(ranks[k][3], s)
        stretch = fill_stretch(model, p, v, schedule, ranks[k][0])
        return work, work * beta / (1 - beta) * stretch, once, stretch

    pace = max(ranks, key=lambda k: sum(pipelined(k)[:3]))
    worst = max(ranks, key=lambda k: ranks[k][1].total)
    _, _, colls, timeb = ranks[pace]
    work, bubble, once, stretch = pipelined(pace)
    one, intra = links.cost(_one_send(p2p_bytes(model, layout, s)), layout, hw, gpus_per_node)
    p2p = exposed_transfers(schedule, p, m, v) * one
    sends = sum(c.count for c in colls if c.mesh_dim == "pp")
    optimizer = max(r[3].optimizer for r in ranks.values())  # after the pipeline, on every rank
    timeb = replace(
        timeb,
        optimizer=optimizer,
        pp_bubble=bubble,
        pp_exposed=p2p,
        step=work + once + bubble + p2p + optimizer,
        comm_total={**timeb.comm_total, "pp": {"seconds": sends * one, "intra_node": intra}},
    )
    info = PipelineInfo(
        schedule, v, m, beta, {k: (r[0], r[1], r[3].busy) for k, r in ranks.items()}, worst, pace, stretch
    )
    # the host check asks the rank offloading the most (the first: most micro-batches in flight)
    mem = replace(ranks[worst][1], host_offload=max(r[1].host_offload for r in ranks.values()))
    return finish(model, layout, s, hw, mem, colls, timeb, global_batch, info)
