"""Before launch, with ``activation_offloading``: the pinned host memory the ranks on this machine
will offload, against the runtime's budget (``techniques/host_budget.py``: 80 % of the machine's
available memory, shared by its ranks). Over it, the offloader keeps the rest of the layer inputs on
the GPU, which the run's memory plan did not count — said before any rank starts, as a note.

What a rank offloads is the planner's estimate (``plan/memory/activations.py: host_bytes``) for the rank that
holds the most: under pipeline parallel the first, every micro-batch in flight of its schedule.
"""

from __future__ import annotations

from dataclasses import dataclass

from ndparallel.config import TrainConfig
from ndparallel.config.plan_settings import plan_settings
from ndparallel.plan.hardware import GiB
from ndparallel.plan.models import from_hf_config
from ndparallel.plan.pipeline.pipeline_estimate import busiest_offload
from ndparallel.techniques.host_budget import HOST_BUDGET_FRACTION, host_budget


@dataclass(frozen=True)
class Offloaded:
    """What the busiest rank offloads at its peak (the planner's ``host_bytes``)."""

    layers: int
    """Its decoder layers (under pipeline parallel the first rank's)."""
    in_flight: float
    """Micro-batches whose activations it holds at once (1 without pipeline parallel)."""
    host_bytes: float
    selective: bool
    """Selective checkpointing: the layers' saved tensors go (else the checkpointed layer inputs)."""


def offloaded(cfg: TrainConfig, pc, hf) -> Offloaded | None:
    """What the busiest rank offloads (None: a model the planner cannot read)."""
    try:
        spec = from_hf_config(hf.to_dict(), str(cfg.base_model))
    except ValueError:
        return None
    layout = pc.dims
    m = cfg.gradient_accumulation_steps  # a pipeline's micro-batches: one per accumulation step
    if layout.pp > 1 and cfg.pipeline_microbatches:  # unless set: the same rows, cut m ways
        m = cfg.pipeline_microbatches
    rows = cfg.micro_batch_size * cfg.gradient_accumulation_steps // m
    s = plan_settings(cfg).but(micro_batch_size=rows, gradient_accumulation_steps=m)
    return Offloaded(*busiest_offload(spec, layout, s), selective=s.recompute == "selective")


def host_memory_note(cfg: TrainConfig, pc, hf, ranks_here: int, available: int | None) -> str | None:
    """The note when the offloaded activations of ``ranks_here`` ranks exceed this machine's budget
    (``available``: its available memory in bytes; None, unknown: no note)."""
    if not cfg.activation_offloading:
        return None
    budget = host_budget(ranks_here, available)
    found = offloaded(cfg, pc, hf)
    if budget is None or found is None or found.host_bytes <= budget:
        return None
    need = found.host_bytes
    return (
        f"activation_offloading: the {ranks_here} rank(s) on this machine offload about "
        f"{need * ranks_here / GiB:.1f} GiB of pinned host memory ({need / GiB:.2f} GiB per rank, the "
        f"planner's estimate), above {HOST_BUDGET_FRACTION:.0%} of the {available / GiB:.1f} GiB available "
        f"here: beyond {budget / GiB:.2f} GiB per rank the layer inputs stay on the GPU, which the memory "
        "plan did not count. Lower micro_batch_size, raise context_parallel_size or "
        "pipeline_parallel_size, free host memory, or check with `ndparallel plan --config CFG "
        "--host-mem SIZE`"
    )
