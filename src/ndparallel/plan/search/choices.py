"""The candidates of each setting the search chooses per layout (``request.SEARCHED``): the pinned
value, else the request's, else what ``auto`` tries. One function per setting; ``evaluation.py``
tries their product."""

from __future__ import annotations

from ndparallel.layout.dims import ParallelDims
from ndparallel.plan.pipeline.schedule_model import AUTO_SCHEDULES, canonical, default_virtual
from ndparallel.plan.search.request import PlanRequest
from ndparallel.plan.settings import Settings

DEFAULT_GLOBAL_BATCH_TOKENS = 2**22
"""Used when no global batch is given: ~4M tokens, rounded per layout (not enforced exactly)."""
AUTO_MICRO_BATCHES = (1, 2, 4, 8)
DEEPEST_INTERLEAVE = 8
"""Besides ``AUTO_SCHEDULES``, the search tries Interleaved1F1B as deep as every stage keeps a layer,
up to this many stages per rank (Meta's Llama-3.1-405B ran 8; Megatron's interleaving guidance is a
few): on 8,192 H100s it finds 39.0 % where v = 2's best is 36.6 % (docs/planner_derivation.md)."""


def micro_batch_sizes(req: PlanRequest, pinned: int | None) -> list[int]:
    """``micro_batch_size``: the pinned one, else the request's, else ``AUTO_MICRO_BATCHES``."""
    if pinned:
        return [pinned]
    return [req.micro_batch_size] if req.micro_batch_size else list(AUTO_MICRO_BATCHES)


def gradient_accumulation_steps(
    req: PlanRequest, layout: ParallelDims, mb: int
) -> tuple[int | None, str | None]:
    """The accumulation steps that make the request's global batch at micro-batch ``mb`` (or about
    ``DEFAULT_GLOBAL_BATCH_TOKENS``), or (None, why not)."""
    per_step = layout.dp * mb
    if req.global_batch_size is None:
        target = max(1, round(DEFAULT_GLOBAL_BATCH_TOKENS / req.settings.sequence_len))
        return max(1, round(target / per_step)), None
    if req.global_batch_size % per_step:
        return None, (
            f"global batch {req.global_batch_size} is not divisible by dp × micro_batch_size = "
            f"{layout.dp} × {mb} = {per_step}"
        )
    return req.global_batch_size // per_step, None


def schedules(
    req: PlanRequest, layout: ParallelDims, schedule: str | None, virtual: int | None
) -> list[tuple[str, int]]:
    """(``pipeline_schedule``, ``pipeline_virtual_stages``) of a layout: one placeholder without PP;
    with ``auto``, ``AUTO_SCHEDULES`` and the deepest interleave (``DEEPEST_INTERLEAVE``)."""
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


def checkpointing(req: PlanRequest, base: Settings, pinned: bool | None) -> list[bool]:
    """``activation_checkpointing``: the pinned value; on with offloading (it moves what
    checkpointing keeps); else the request's auto (both), on or off."""
    if pinned is not None:
        return [pinned]
    if base.activation_offloading:
        return [True]
    return {"auto": [False, True], "on": [True], "off": [False]}[req.activation_checkpointing]


def grad_syncs(req: PlanRequest, layout: ParallelDims, pinned: bool | None) -> list[bool]:
    """``unsharded_grad_accumulation``: the pinned value, else the request's, else (auto) both for a
    pp layout with FSDP or replicas, the runtime's default (False) otherwise."""
    if pinned is not None or req.unsharded_grad_accumulation is not None:
        return [req.unsharded_grad_accumulation if pinned is None else pinned]
    return [False, True] if layout.pp > 1 and layout.dp_replicate * layout.fsdp > 1 else [False]
