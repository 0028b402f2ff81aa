"""What a dense layer's backward holds beyond its saved set, stage by stage, per local token: the
two terms of ``memory._workspace`` that follow autograd freeing the layer's tensors as it goes
(docs/planner_derivation.md, *Long context*)."""

from __future__ import annotations

from ndparallel.plan.layout import Layout, Settings
from ndparallel.plan.long_context import (
    lean_norm_tile_bytes,
    norm_saved_per_row,
    tiled_saved_reduction_per_token,
)
from ndparallel.plan.models import ModelSpec
from ndparallel.plan.sp_activations import block_input_divisor


def norm_backward_stage(model: ModelSpec, layout: Layout, s: Settings, tokens: float) -> float:
    """The post-attention RMSNorm's backward stage of ``tokens``: HF's (``norm_backward_per_token``
    per token) or, with the tiled MLP, the lean norm's one tile (``lean_norm_tile_bytes``)."""
    tile = lean_norm_tile_bytes(model, layout, s)
    return tokens * norm_backward_per_token(model, layout, s) if tile is None else tile


def norm_backward_per_token(model: ModelSpec, layout: Layout, s: Settings) -> float:
    """The post-attention RMSNorm's backward beyond the saved set and the residual-stream
    gradients, per token. HF's norm runs in fp32 (``x.float()``, ``pow(2).mean``, ``x·rsqrt``):
    inside the ``pow``'s backward five fp32 ``[tokens, h/t_sp]`` tensors are alive at once — the
    gradient through ``x·rsqrt`` (waiting to be summed), the mean's expanded gradient and the
    pow's ``x¹``, ``2·x¹`` and product (``20·h/t_sp``; measured, ``bench/simulate_long_context.py``).
    By then the MLP half is freed but for the norm's fp32 input (``mlp_half_saved_per_token`` less
    ``4·h/t_sp``), and the norm's incoming gradient is consumed: one residual-stream gradient
    (``e·h/t_sp``) fewer than the two counted. The larger stage only once the MLP keeps no
    intermediates (tiled): untiled, gate/up/product freed by then outweigh the five."""
    t_sp = layout.tp if s.sequence_parallel else 1
    fp32_input = 4 * model.hidden / t_sp
    mlp_half = mlp_half_saved_per_token(model, layout, s)
    freed = mlp_half - fp32_input if mlp_half else 0.0  # 0: the saved set counted whole
    return 5 * fp32_input - freed - s.act_bytes * model.hidden / t_sp


def mlp_half_saved_per_token(model: ModelSpec, layout: Layout, s: Settings) -> float:
    """What a layer's saved set no longer holds when its backward reaches the attention: the MLP
    half's tensors, freed by autograd as their backward ran — the post-attention RMSNorm's (its
    fp32 input, normalized output and reciprocal RMS, ``((4+e)·h + 4)/t_sp``; lean, its input and
    reciprocal RMS, ``(e·h + 4)/t_sp``: ``norm_saved_per_row``), the MLP's input
    (``e·h`` / its divisor; tiled, the tiled block's ``e·h/t_sp``) and, untiled, gate, SiLU, up and
    their product (``4·e·f/t``). Counted for dense models under full or no checkpointing (the
    selective policy and MoE blocks keep other sets: 0, the upper bound as before)."""
    if model.is_moe or s.recompute == "selective":
        return 0.0
    t, e, h = layout.tp, s.act_bytes, model.hidden
    t_sp = t if s.sequence_parallel else 1
    norm = norm_saved_per_row(h, s) / t_sp
    mlp = e * h / block_input_divisor(layout, s) + 4 * e * model.intermediate / t
    return norm + mlp - tiled_saved_reduction_per_token(model, layout, s)
