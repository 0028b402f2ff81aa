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


POLICIES = ("selective", "full")
"""The checkpointing policies ``auto`` tries, the faster first ('op', torchtitan's, only pinned: the
runtime does not run it)."""


def checkpointing(
    req: PlanRequest, checkpointed: bool | None, policy: str | None, offloaded: bool | None
) -> list[tuple[bool, str, bool]]:
    """(``activation_checkpointing``, ``ac_policy``, ``activation_offloading``) of a layout, the
    least recompute first, each policy without offloading before with it (``evaluation.py`` tries an
    offloaded option only where the same one kept on the device does not fit: it adds copies, never
    time saved). Pinned (the arguments), else the request's, else: checkpointing off and on, the
    ``POLICIES``, offloading off and on. Offloading moves what checkpointing keeps: pinned on, it
    pins checkpointing on unless that is pinned off (then nothing is offloaded)."""
    offloads = [offloaded] if offloaded is not None else _or_both(req.activation_offloading)
    ck = [checkpointed] if checkpointed is not None else _on_off(req.activation_checkpointing)
    policies = [policy] if policy else [req.ac_policy] if req.ac_policy else list(POLICIES)
    if offloads == [True] and True in ck:  # offloading pinned on: checkpointing on
        ck = [True]
    out = [(False, "full", False)] if False in ck else []
    return out + ([(True, p, o) for p in policies for o in offloads] if True in ck else [])


def reshards(req: PlanRequest, layout: ParallelDims, base: Settings, pinned: bool | None) -> list[bool]:
    """``reshard_after_forward``: pinned, else the request's, else keep the gathered parameters
    (False) and reshard (True) where FSDP gathers them (a sharded or replicated layout, or a cast to
    the compute dtype); elsewhere the runtime's default, True, which then changes nothing."""
    if pinned is not None or req.reshard_after_forward is not None:
        return [req.reshard_after_forward if pinned is None else pinned]
    gathers = layout.dp_replicate * layout.fsdp > 1 or base.mixed_precision != "fp32"
    return [False, True] if gathers else [True]


def tiling(req: PlanRequest, pinned: bool | None) -> list[bool]:
    """``tiled_mlp``: pinned, else the request's, else untiled then tiled — tried in that order, the
    tiled MLP only for a layout where no untiled option fits (it is what makes that sequence fit:
    one more MLP forward per layer)."""
    if pinned is not None or req.tiled_mlp is not None:
        return [req.tiled_mlp if pinned is None else pinned]
    return [False, True]


def _on_off(value: str) -> list[bool]:
    return {"auto": [False, True], "on": [True], "off": [False]}[value]


def _or_both(value: bool | None) -> list[bool]:
    return [False, True] if value is None else [value]


def grad_syncs(req: PlanRequest, layout: ParallelDims, pinned: bool | None) -> list[bool]:
    """``unsharded_grad_accumulation``: the pinned value, else the request's, else (auto) both for a
    pp layout with FSDP or replicas, the runtime's default (False) otherwise."""
    if pinned is not None or req.unsharded_grad_accumulation is not None:
        return [req.unsharded_grad_accumulation if pinned is None else pinned]
    return [False, True] if layout.pp > 1 and layout.dp_replicate * layout.fsdp > 1 else [False]
