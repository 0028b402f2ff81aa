"""Checkpointing policies the planner models but the runtime does not run, for comparisons with
published rows: torchtitan's per-op selective policy (the policy 'op'). The runtime's
own policies are in ``plan/memory.py`` (full: each layer's input; selective:
``selective_saved_per_token``)."""

from __future__ import annotations

from ndparallel.plan.layout import Layout, Settings
from ndparallel.plan.models import ModelSpec


def op_policy_saved_per_token(model: ModelSpec, layout: Layout, s: Settings) -> float:
    """torchtitan's per-op policy (``selective_ac_option = 'op'``; policy 'op', modelled for
    comparisons with its published rows, not run by ndparallel): the layer input (``e·h/t_sp``),
    the outputs of q (``e·a·d/t``), v (``e·k·d/t``), gate (``e·f/t``) and down (``e·h``, before
    the reduce-scatter under SP: full), the attention output (``e·a·d/t``) and log-sum-exp
    (``4·a/t``)."""
    t, e = layout.tp, s.act_bytes
    t_sp = t if s.sequence_parallel else 1
    h, d = model.hidden, model.head_dim
    return (
        e * h / t_sp
        + e * (2 * model.heads + model.kv_heads) * d / t
        + e * model.intermediate / t
        + e * h
        + 4 * model.heads / t
    )
