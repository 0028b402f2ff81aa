"""Activation memory of one micro-batch, per local token and layer: what each decoder layer saves for
backward under each checkpointing policy (none, full, selective, torchtitan's op policy), what
offloading moves to the host, and what a layer's backward holds beyond its saved set, stage by stage
(autograd frees the layer's tensors as it goes: docs/planner_derivation.md, *Long context*). The
shares of context parallel (``cp_memory.py``), sequence parallel (``sp_activations.py``), the
long-context options (``long_context.py``) and QAT (``qat_memory.py``) are in their own modules."""

from __future__ import annotations

from ndparallel.layout.dims import ParallelDims
from ndparallel.plan import moe_cost
from ndparallel.plan.memory.cp_memory import attention_scratch_per_token, cp_saved_extra_per_token
from ndparallel.plan.memory.long_context import (
    checkpointed_input_per_token,
    device_checkpointed_layers,
    lean_norm_tile_bytes,
    mlp_gradient_workspace_per_token,
    norm_saved_per_row,
    offloading,
    selective_offload_residue_per_token,
    tile_working_set,
    tiled_saved_reduction_per_token,
)
from ndparallel.plan.memory.qat_memory import qat_head_bytes, qat_layer_bytes
from ndparallel.plan.memory.sp_activations import block_input_divisor, block_inputs_per_token
from ndparallel.plan.models import ModelSpec
from ndparallel.plan.pipeline.schedule_model import rank_stages
from ndparallel.plan.settings import Settings
from ndparallel.plan.time.recompute_policies import op_policy_saved_per_token


def layer_activation_bytes_per_token(model: ModelSpec, layout: ParallelDims, s: Settings) -> float:
    """Bytes one decoder layer keeps for backward per local token (no checkpointing).

    Per token (h hidden, d head dim, a/k q/kv heads, f MLP width, t = tp, t_sp = tp with
    sequence parallel else 1, e = activation bytes):
      2 RMSNorms, each fp32 input + normalized output
      + its fp32 reciprocal RMS (one per token):         2·((4+e)·h + 4) / t_sp
      q/k/v input and MLP input (sequence shards under SP): 2·e·h / t_sp (plan/memory/sp_activations.py)
      q, k, v after RoPE kept by attention:              e·(a+2k)·d / t
      attention output (also o_proj input):              e·a·d / t
      log-sum-exp:                                       4·a / t
      gate, SiLU(gate), up, product (down_proj input):   4·e·f / t
      (Qwen3 q/k RMSNorms:                               (4+e)·(a+k)·d / t + 4·(a+k) / t)
    With the tiled MLP the norms are lean: ``e`` per value instead of ``4+e`` (``norm_saved_per_row``).
    """
    h, d, a, k, f = model.hidden, model.head_dim, model.heads, model.kv_heads, model.intermediate
    t = layout.tp
    t_sp = t if s.sequence_parallel else 1
    e = s.act_bytes
    per = 2 * norm_saved_per_row(h, s) / t_sp + block_inputs_per_token(model, layout, s)
    per += e * (a + 2 * k) * d / t + e * a * d / t + 4 * a / t + 4 * e * f / t
    if model.qk_norm:
        per += norm_saved_per_row(d, s) * (a + k) / t
    if model.is_moe:  # router, experts, shared MLP instead of the MLP (f = 0): plan/moe_cost.py
        per += moe_cost.activation_bytes_per_token(model, layout, s)
    return per + cp_saved_extra_per_token(model, layout, s)


def layer_backward_workspace_per_token(model: ModelSpec, layout: ParallelDims, s: Settings) -> float:
    """Gradient tensors alive at once in one layer's backward, per local token: the MLP stage's
    gradients of gate, up and their product (``3·e·f/t``) with the incoming and outgoing
    residual-stream gradients (``2·e·h/t_sp``)."""
    t_sp = layout.tp if s.sequence_parallel else 1
    e = s.act_bytes
    if model.is_moe:
        return moe_cost.workspace_per_token(model, layout, s) + 2 * e * model.hidden / t_sp
    return 3 * e * model.intermediate / layout.tp + 2 * e * model.hidden / t_sp


def selective_saved_per_token(model: ModelSpec, layout: ParallelDims, s: Settings) -> float:
    """Bytes per token one layer keeps under the runtime's selective policy
    (``techniques/selective_ac.py``: norms and the MLP activation recomputed): the two norms'
    inputs (``2·e·h/t_sp``; the second is the layer's input, kept by its checkpointed norm), the
    blocks' inputs (``plan/memory/sp_activations.py``), q, k, v, the attention output and log-sum-exp as
    without checkpointing, the MLP's gate and up (``2·e·f/t``) and, under TP, the output of
    ``down_proj``'s collective, kept by the policy (``e·h/t_sp``); Qwen3's q/k norms their inputs
    (``e·(a+k)·d/t``). Measured equal on CPU (``bench/sp_activation_memory.py``, 2026-12-06: tp 1
    and 8, h 512). A mixture-of-experts model cannot run it (the runtime refuses): its plain saved
    set."""
    if model.is_moe:
        return layer_activation_bytes_per_token(model, layout, s)
    t, e = layout.tp, s.act_bytes
    t_sp = t if s.sequence_parallel else 1
    h, d, a, k = model.hidden, model.head_dim, model.heads, model.kv_heads
    per = 2 * e * h / t_sp + block_inputs_per_token(model, layout, s)
    per += e * (2 * a + 2 * k) * d / t + 4 * a / t + 2 * e * model.intermediate / t
    if t > 1:
        per += e * h / t_sp
    if model.qk_norm:
        per += e * (a + k) * d / t
    return per + cp_saved_extra_per_token(model, layout, s)


def offload_split_per_token(model: ModelSpec, layout: ParallelDims, s: Settings) -> tuple[float, float]:
    """(on the device, in host memory) bytes per local token and layer of what activation
    offloading handles (``plan/memory/long_context.py``); (0, 0) without it. Full checkpointing: the layer
    input moves (on the device only those in flight, ``device_checkpointed_layers``); selective:
    the selective saved set moves but its residue (``selective_offload_residue_per_token``)."""
    if not offloading(s):
        return 0.0, 0.0
    if s.recompute == "selective":
        kept = selective_offload_residue_per_token(model, layout, s)
        return kept, selective_saved_per_token(model, layout, s) - kept
    return 0.0, checkpointed_input_per_token(model, layout, s)


def offloaded_layer_bytes(model: ModelSpec, layout: ParallelDims, s: Settings) -> float:
    """One layer's offloaded bytes of one micro-batch: what one copy moves each way."""
    return s.micro_batch_size * s.sequence_len / layout.cp * offload_split_per_token(model, layout, s)[1]


def host_bytes(model: ModelSpec, layout: ParallelDims, s: Settings) -> float:
    """Host (pinned) memory per GPU: every layer's offloaded bytes of every micro-batch in flight
    (``s.pp_in_flight``: on a pipeline's first rank about ``p`` micro-batches, each held from its
    forward to its backward); with selective checkpointing RoPE's cos and sin too (``2·e·d`` per
    token), saved by every layer, offloaded once per forward of each stage (measured, 2026-12-06:
    ``bench/sp_activation_memory.py``'s ``selective_offload``)."""
    per_micro_batch = model.layers * offloaded_layer_bytes(model, layout, s)
    if per_micro_batch and s.recompute == "selective":
        tokens = s.micro_batch_size * s.sequence_len / layout.cp
        per_micro_batch += rank_stages(layout, s) * tokens * 2 * s.act_bytes * model.head_dim
    return s.pp_in_flight * per_micro_batch


def saved_activations(model: ModelSpec, layout: ParallelDims, s: Settings, tokens: float) -> tuple:
    """(saved for backward at the peak with one micro-batch in flight, one layer's plain saved
    set, the same less what the tiled MLP drops, QAT's share per layer, QAT's share of the head),
    bytes of ``tokens`` per micro-batch."""
    e = s.act_bytes
    plain_layer = layer_activation_bytes_per_token(model, layout, s) * tokens
    per_layer = plain_layer - tiled_saved_reduction_per_token(model, layout, s) * tokens
    if s.recompute == "selective":
        # the layer in backward recomputes the rest of its plain set: its kept set is counted below
        # (offloaded: its residue there, the rest back on the device in the workspace); under TP
        # the kept set has one tensor the plain set has not (the output of down_proj's collective)
        kept_of_plain = selective_saved_per_token(model, layout, s) - selective_offload_residue_per_token(
            model, layout, s
        )
        per_layer -= tokens * kept_of_plain
    if s.recompute == "full" and recomputed_input_is_kept_input(s):
        per_layer -= tokens * checkpointed_input_per_token(model, layout, s)
    if s.recompute == "selective" and offloading(s):  # the residue stays on the device
        saved = model.layers * tokens * offload_split_per_token(model, layout, s)[0]
    elif s.recompute == "selective":
        saved = model.layers * tokens * selective_saved_per_token(model, layout, s)
    elif s.recompute == "op":
        saved = model.layers * tokens * op_policy_saved_per_token(model, layout, s)
    elif s.activation_checkpointing:  # each layer's input only (with offloading: the ones on the device)
        saved = device_checkpointed_layers(model, s) * tokens * checkpointed_input_per_token(model, layout, s)
    else:
        saved = model.layers * per_layer
    # QAT: each layer's fake-quantiser share until its backward; under checkpointing one layer's,
    # while it is recomputed (plan/memory/qat_memory.py). The head's is held until the loss backward.
    qat_layer = qat_head = 0.0
    if s.qat:
        qat_layer = qat_layer_bytes(model, s.qat, tokens, frozen=bool(s.lora_r), compute_bytes=e)
        qat_head = qat_head_bytes(model, s.qat, tokens, frozen=bool(s.lora_r), compute_bytes=e)
        saved += 0.0 if s.activation_checkpointing else model.layers * qat_layer
    # RoPE cos and sin (b, s/c, d) in activation dtype, shared by all layers.
    saved += 2 * tokens * model.head_dim * e
    return saved, plain_layer, per_layer, qat_layer, qat_head


def recomputed_input_is_kept_input(s: Settings) -> bool:
    """Whether a recomputed layer's input norm saves the checkpointed input itself, not a copy:
    the lean norm (with the tiled MLP) saves its input as it is, and HF's norm its ``x.float()``,
    which is ``x`` when activations are fp32. Then full checkpointing holds that input once, not
    again in the recomputed set (measured: ``bench/simulate_settings.py``)."""
    return s.tiled_mlp or s.act_bytes == 4


def backward_workspace(model: ModelSpec, layout: ParallelDims, s: Settings, tokens: float) -> float:
    """One layer's backward workspace: the largest of its MLP stage (with the tiled MLP: per tile
    only), its post-attention RMSNorm's backward (``norm_backward_stage``) and its attention
    stage (CP buffers, less the MLP half's saved tensors, freed by then:
    ``mlp_half_saved_per_token``), each with the residual-stream gradients."""
    per_token = layer_backward_workspace_per_token(model, layout, s)
    mlp = mlp_gradient_workspace_per_token(model, layout, s)
    residual = tokens * (per_token - mlp)
    if s.tiled_mlp:
        mlp_stage = tile_working_set(model, layout, s)
    else:
        mlp_stage = tokens * (mlp - mlp_stage_absent_per_token(model, layout, s))
    attention_stage = tokens * (
        attention_scratch_per_token(model, layout, s) - mlp_half_saved_per_token(model, layout, s)
    )
    later = tokens * offloaded_attention_half_per_token(model, layout, s)
    return residual + max(
        mlp_stage - later, norm_backward_stage(model, layout, s, tokens) - later, attention_stage
    )


def offloaded_attention_half_per_token(model: ModelSpec, layout: ParallelDims, s: Settings) -> float:
    """Selective checkpointing with offloading: the share of a layer's offloaded set (counted back
    on the device for its backward) that is not back yet in its MLP and post-attention norm stages.
    The offloader fetches a storage when backward unpacks it, prefetching the one saved before it:
    there only the MLP half is back — the post-attention norm's input (``e·h/t_sp``), the MLP's input
    (``e·h`` / its divisor), gate and up (``2·e·f/t``); the attention half comes back when the
    attention's backward starts (measured: ``bench/simulate_settings.py``). 0 otherwise."""
    if s.recompute != "selective" or not offloading(s) or model.is_moe:
        return 0.0
    t, e, h = layout.tp, s.act_bytes, model.hidden
    t_sp = t if s.sequence_parallel else 1
    mlp_half = e * h / t_sp + e * h / block_input_divisor(layout, s) + 2 * e * model.intermediate / t
    return offload_split_per_token(model, layout, s)[1] - mlp_half


def mlp_stage_absent_per_token(model: ModelSpec, layout: ParallelDims, s: Settings) -> float:
    """What the layer's recomputed set and the two residual-stream gradients hold but its untiled
    MLP's backward stage does not, per token. That stage peaks in the product's backward (the
    gradients of SiLU(gate), up and the product alive at once): by then ``down_proj``'s backward has
    freed its input, the product (``e·f/t``); the only residual-stream gradient is the incoming one,
    the layer input's is made at its input norm's backward (``e·h/t_sp``); under the selective
    policy each checkpointed norm is recomputed in its own backward, after the MLP's: their fp32
    copies beyond the kept inputs (``2·(4·h + 4)/t_sp``; Qwen3's q/k norms ``(4·d + 4)·(a+k)/t``) are
    not there yet (measured: ``bench/simulate_settings.py``). Dense models only (0 for MoE blocks and
    torchtitan's op policy: their sets are modelled whole)."""
    if model.is_moe or s.recompute == "op":
        return 0.0
    t, e, h = layout.tp, s.act_bytes, model.hidden
    t_sp = t if s.sequence_parallel else 1
    absent = e * model.intermediate / t + e * h / t_sp
    if s.recompute == "selective":
        absent += 2 * (norm_saved_per_row(h, s) - e * h) / t_sp
        if model.qk_norm:
            absent += (
                (norm_saved_per_row(model.head_dim, s) - e * model.head_dim)
                * (model.heads + model.kv_heads)
                / t
            )
    return absent


def norm_backward_stage(model: ModelSpec, layout: ParallelDims, s: Settings, tokens: float) -> float:
    """The post-attention RMSNorm's backward stage of ``tokens``: HF's (``norm_backward_per_token``
    per token) or, with the tiled MLP, the lean norm's one tile (``lean_norm_tile_bytes``)."""
    tile = lean_norm_tile_bytes(model, layout, s)
    return tokens * norm_backward_per_token(model, layout, s) if tile is None else tile


def norm_backward_per_token(model: ModelSpec, layout: ParallelDims, s: Settings) -> float:
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


def mlp_half_saved_per_token(model: ModelSpec, layout: ParallelDims, s: Settings) -> float:
    """What a layer's saved set no longer holds when its backward reaches the attention: the MLP
    half's tensors, freed by autograd as their backward ran — the post-attention RMSNorm's (its
    fp32 input, normalized output and reciprocal RMS, ``((4+e)·h + 4)/t_sp``; lean, its input and
    reciprocal RMS, ``(e·h + 4)/t_sp``: ``norm_saved_per_row``), the MLP's input
    (``e·h`` / its divisor; tiled, the tiled block's ``e·h/t_sp``) and, untiled, gate, SiLU, up and
    their product (``4·e·f/t``). The selective policy holds the same tensors, kept (the norm's
    input, gate, up, the MLP's input) or recomputed (the norm's fp32 copies, SiLU(gate), the
    product), and under TP the output of ``down_proj``'s collective it keeps (``e·h/t_sp``). Dense
    models under no, full or selective checkpointing (MoE blocks and torchtitan's op policy keep
    other sets: 0, the upper bound as before)."""
    if model.is_moe or s.recompute == "op":
        return 0.0
    t, e, h = layout.tp, s.act_bytes, model.hidden
    t_sp = t if s.sequence_parallel else 1
    norm = norm_saved_per_row(h, s) / t_sp
    mlp = e * h / block_input_divisor(layout, s) + 4 * e * model.intermediate / t
    if s.recompute == "selective" and t > 1:
        mlp += e * h / t_sp
    return norm + mlp - tiled_saved_reduction_per_token(model, layout, s)
