"""A pipeline-parallel layout's estimate: its first and last pp ranks modelled as ranks of their
own (``estimate.rank_step`` on ``pipeline.rank_model``), the slowest setting the pace.

Step = work(slowest rank) / (1 − β) + exposed transfers + the optimizer step, β the schedule's
bubble fraction, work = the rank's micro-batches with their exposed TP/CP/FSDP communication.
Reported memory: the larger rank's."""

from __future__ import annotations

from dataclasses import replace

from ndparallel.parallel.pipeline_split import ZERO_BUBBLE_SCHEDULES
from ndparallel.plan import comms
from ndparallel.plan.comms import Collective
from ndparallel.plan.estimate import Estimate, finish, rank_step
from ndparallel.plan.hardware import Hardware
from ndparallel.plan.layout import Layout, Settings
from ndparallel.plan.models import ModelSpec
from ndparallel.plan.pipeline import (
    PipelineInfo,
    bubble_fraction,
    exposed_transfers,
    in_flight,
    measured_ranks,
    p2p_bytes,
    p2p_collectives,
    rank_model,
    rank_shape,
)


def rank_settings(s: Settings, p: int, rank: int, last: bool) -> Settings:
    """``s`` for one pp rank: its in-flight micro-batches, gradients reduced every micro-batch
    (the runtime's, ``Settings.sync_every_microbatch``); on the last stage under a zero-bubble
    schedule the full-logits loss (the runtime's: the chunked loss cannot split its backward)."""
    loss = "full" if last and s.pp_schedule in ZERO_BUBBLE_SCHEDULES else s.loss_impl
    return replace(s, pp_in_flight=in_flight(s.pp_schedule, p, s.grad_accum, s.pp_virtual, rank),
                   loss_impl=loss, sync_every_microbatch=True)


def estimate_pipeline(model: ModelSpec, layout: Layout, s: Settings, hw: Hardware, gpus_per_node: int,
                      global_batch: int | None = None) -> Estimate:
    """The estimate of a pp layout (``s.pp_schedule``, ``s.pp_virtual``, m = ``s.grad_accum``)."""
    p, m, v, schedule = layout.pp, s.grad_accum, s.pp_virtual, s.pp_schedule
    ranks = {}
    for rank in measured_ranks(p, schedule):
        shape = rank_shape(model, p, v, schedule, rank)
        part = rank_model(model, shape)
        rs = rank_settings(s, p, rank, shape.last)
        mem, colls, timeb = rank_step(part, layout, rs, hw, gpus_per_node)
        colls = colls + p2p_collectives(part, layout, rs, shape, Collective)
        ranks["first" if rank == 0 else "last"] = (shape, mem, colls, timeb)
    # A micro-batch's exposed FSDP traffic (every stage gathers and reduces on every micro-batch)
    # is on its rank's critical path like its compute: the slowest such rank paces the pipeline.
    pace = max(ranks, key=lambda k: ranks[k][3].busy + ranks[k][3].dp_exposed)
    worst = max(ranks, key=lambda k: ranks[k][1].total)
    _, _, colls, timeb = ranks[pace]
    beta = bubble_fraction(schedule, p, m, v)
    work = timeb.busy + timeb.dp_exposed
    bubble = work * beta / (1 - beta)
    one, intra = comms.cost(Collective("send_recv", "pp", p2p_bytes(model, layout, s), 1, ""),
                            layout, hw, gpus_per_node)
    p2p = exposed_transfers(schedule, p, m, v) * one
    sends = sum(c.count for c in colls if c.mesh_dim == "pp")
    optimizer = max(r[3].optimizer for r in ranks.values())  # after the pipeline, on every rank
    timeb = replace(timeb, optimizer=optimizer, pp_bubble=bubble, pp_exposed=p2p,
                    step=work + bubble + p2p + optimizer,
                    comm_total={**timeb.comm_total, "pp": {"seconds": sends * one, "intra_node": intra}})
    info = PipelineInfo(schedule, v, m, beta, {k: (r[0], r[1], r[3].busy) for k, r in ranks.items()},
                        worst, pace)
    return finish(model, layout, s, hw, ranks[worst][1], colls, timeb, global_batch, info)
