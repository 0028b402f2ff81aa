"""Peak memory per GPU of one layout: states, activations, FSDP buffers, logits, overhead.

Peak = the largest of three moments: (A) the loss backward (saved activations of all layers,
logits and loss tensors, the head unit gathered), (B) the first layer's backward (its working
set, its gathered params plus prefetch and its unsharded gradient), (C) the end of backward (all
gradients, before the optimizer step). fp32 master params and optimizer states are always there;
gradients only from their unit's backward on (``zero_grad(set_to_none=True)``) unless they are
kept or accumulated. Checked on the H200 (``bench/reference``): docs/planner.md.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from functools import lru_cache

from ndparallel.plan import moe_cost, muon_cost
from ndparallel.plan.adapter import (
    adapter_layer_local,
    adapter_shard_numel,
    head_copy_trains,
    saved_copy_shard_numel,
    saved_copy_units,
)
from ndparallel.plan.comms import unit_numels
from ndparallel.plan.compute import micro_batch_key
from ndparallel.plan.cp_memory import attention_scratch_per_token, cp_saved_extra_per_token
from ndparallel.plan.embedding_moment import (
    embedding_backward_bytes,
    embedding_shard_grad_bytes,
    kept_gathered_bytes,
)
from ndparallel.plan.hardware import Hardware
from ndparallel.plan.layer_backward import mlp_half_saved_per_token, norm_backward_stage
from ndparallel.plan.layout import Layout, Settings
from ndparallel.plan.long_context import (
    checkpointed_input_per_token,
    device_checkpointed_layers,
    mlp_gradient_workspace_per_token,
    norm_saved_per_row,
    offloading,
    selective_offload_residue_per_token,
    tile_working_set,
    tiled_saved_reduction_per_token,
)
from ndparallel.plan.loss_memory import chunk_head_grad_bytes, chunk_logit_bytes, chunk_tokens
from ndparallel.plan.memo import Memo
from ndparallel.plan.models import ModelSpec, fsdp_units
from ndparallel.plan.pipeline import rank_stages, stage_inputs_held, stage_outputs_held
from ndparallel.plan.qat_memory import qat_head_bytes, qat_layer_bytes
from ndparallel.plan.qlora import memory_adjustments
from ndparallel.plan.recompute_policies import op_policy_saved_per_token
from ndparallel.plan.sp_activations import block_inputs_per_token

FRAGMENTATION = 0.05
"""Allocator slack added on top of the transient (activation, buffer, logits) bytes."""


@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes per GPU present at the peak; the fields sum to ``total``."""

    params: float
    grads: float
    optimizer: float
    activations: float
    logits: float
    fsdp_buffers: float
    overhead: float
    total: float
    peak_phase: str
    activation_bytes_per_layer: float
    """Saved by one layer without checkpointing (one micro-batch)."""
    host_offload: float = 0.0
    """Host (pinned) bytes per GPU of offloaded activations, every micro-batch in flight
    (``host_bytes``); not part of ``total``."""

    @property
    def allocated(self) -> float:
        """Predicted peak of ``torch.cuda.max_memory_allocated``: ``total`` less the runtime
        (CUDA context, NCCL) and fragmentation allowance, which live outside it."""
        return self.total - self.overhead

    def to_dict(self) -> dict:
        return {**asdict(self), "allocated": self.allocated}


def layer_activation_bytes_per_token(model: ModelSpec, layout: Layout, s: Settings) -> float:
    """Bytes one decoder layer keeps for backward per local token (no checkpointing).

    Per token (h hidden, d head dim, a/k q/kv heads, f MLP width, t = tp, t_sp = tp with
    sequence parallel else 1, e = activation bytes):
      2 RMSNorms, each fp32 input + normalized output
      + its fp32 reciprocal RMS (one per token):         2·((4+e)·h + 4) / t_sp
      q/k/v input and MLP input (sequence shards under SP): 2·e·h / t_sp (plan/sp_activations.py)
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


def layer_backward_workspace_per_token(model: ModelSpec, layout: Layout, s: Settings) -> float:
    """Gradient tensors alive at once in one layer's backward, per local token: the MLP stage's
    gradients of gate, up and their product (``3·e·f/t``) with the incoming and outgoing
    residual-stream gradients (``2·e·h/t_sp``)."""
    t_sp = layout.tp if s.sequence_parallel else 1
    e = s.act_bytes
    if model.is_moe:
        return moe_cost.workspace_per_token(model, layout, s) + 2 * e * model.hidden / t_sp
    return 3 * e * model.intermediate / layout.tp + 2 * e * model.hidden / t_sp


def selective_saved_per_token(model: ModelSpec, layout: Layout, s: Settings) -> float:
    """Bytes per token one layer keeps under the runtime's selective policy
    (``techniques/selective_ac.py``: norms and the MLP activation recomputed): the two norms'
    inputs (``2·e·h/t_sp``; the second is the layer's input, kept by its checkpointed norm), the
    blocks' inputs (``plan/sp_activations.py``), q, k, v, the attention output and log-sum-exp as
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


def offload_split_per_token(model: ModelSpec, layout: Layout, s: Settings) -> tuple[float, float]:
    """(on the device, in host memory) bytes per local token and layer of what activation
    offloading handles (``plan/long_context.py``); (0, 0) without it. Full checkpointing: the layer
    input moves (on the device only those in flight, ``device_checkpointed_layers``); selective:
    the selective saved set moves but its residue (``selective_offload_residue_per_token``)."""
    if not offloading(s):
        return 0.0, 0.0
    if s.recompute == "selective":
        kept = selective_offload_residue_per_token(model, layout, s)
        return kept, selective_saved_per_token(model, layout, s) - kept
    return 0.0, checkpointed_input_per_token(model, layout, s)


def offloaded_layer_bytes(model: ModelSpec, layout: Layout, s: Settings) -> float:
    """One layer's offloaded bytes of one micro-batch: what one copy moves each way."""
    return s.micro_batch * s.seq_len / layout.cp * offload_split_per_token(model, layout, s)[1]


def host_bytes(model: ModelSpec, layout: Layout, s: Settings) -> float:
    """Host (pinned) memory per GPU: every layer's offloaded bytes of every micro-batch in flight
    (``s.pp_in_flight``: on a pipeline's first rank about ``p`` micro-batches, each held from its
    forward to its backward); with selective checkpointing RoPE's cos and sin too (``2·e·d`` per
    token), saved by every layer, offloaded once per forward of each stage (measured, 2026-12-06:
    ``bench/sp_activation_memory.py``'s ``selective_offload``)."""
    per_micro_batch = model.layers * offloaded_layer_bytes(model, layout, s)
    if per_micro_batch and s.recompute == "selective":
        tokens = s.micro_batch * s.seq_len / layout.cp
        per_micro_batch += rank_stages(layout, s) * tokens * 2 * s.act_bytes * model.head_dim
    return s.pp_in_flight * per_micro_batch


def _logits_bytes(model: ModelSpec, layout: Layout, s: Settings, tokens: float) -> float:
    """Logits and loss tensors at the loss backward's peak, plus the final norm and LM-head input.

    Per logit: the logits (e), the fp32 log-softmax kept for backward, and in its backward two
    fp32 gradients (nll, log-softmax) = e + 12 (measured on the H200: 14 B per logit in bf16);
    loss parallel's fused nll + log-softmax backward (torch.distributed.tensor.parallel.loss)
    holds zeros_like(x), exp(x) and their sum at once = e + 16.
    The chunked loss (``techniques/chunked_ce.py``, the runtime's default) computes its gradients
    during the forward: one chunk's fp32 logits and, under mixed precision, their compute-dtype
    copy (``chunk_logit_bytes``: 4 + e per logit, 4 in fp32),
    the hidden-state gradient (e per hidden value) and an fp32 LM-head weight-gradient accumulator
    with, under mixed precision, one vocabulary slice of a chunk's contribution before it is added
    (``chunk_head_grad_bytes``: 4 per weight of the local vocabulary slice, + (e + 4) per chunk
    logit) — or, if larger, its backward: the accumulator and the returned gradient (4 + e per
    weight);
    never the full logits."""
    t, e = layout.tp, s.act_bytes
    t_sp = t if s.sequence_parallel else 1
    v_local = -(-model.vocab // t)
    if s.loss_impl == "chunked":
        chunk = chunk_tokens(s, v_local, tokens)
        forward = chunk * v_local * chunk_logit_bytes(e) + chunk_head_grad_bytes(
            e, chunk, v_local, model.hidden
        )
        # its backward returns the weight gradient in the compute dtype beside the fp32 accumulator
        backward = v_local * model.hidden * (4 + (e if e != 4 else 0))
        out = max(forward, backward) + tokens * model.hidden * e
    elif s.loss_parallel and t > 1:
        out = tokens * v_local * (e + 16)
    else:
        out = tokens * model.vocab * (e + 12)
    return out + tokens * (norm_saved_per_row(model.hidden, s) / t_sp + e * model.hidden)


def _buffers(
    model: ModelSpec, layout: Layout, s: Settings, numels: dict, accumulating: bool = False
) -> tuple[float, float]:
    """FSDP's unsharded parameters and gradients at (loss moment, layer moment).

    Loss moment: the head unit gathered (its gradient comes after the loss backward's peak).
    Layer moment: the layer in use and ``prefetch`` more gathered in compute dtype, its unsharded
    gradient in compute dtype plus the fp32 copy fed to reduce-scatter, or the larger one of the
    head unit FSDP2 still holds at the last layer (``accumulating``
    unsharded: the gradient is added into the kept one, no copy); tied models keep the root
    unit gathered, and its unsharded gradient, until the embedding's backward at the end. Without
    ``reshard_after_forward`` every layer stays gathered from forward to backward; without
    ``reshard_after_backward`` from one micro-batch's backward to the next forward."""
    n, cb, e, rb = layout.fsdp, s.param_compute_bytes, s.act_bytes, s.reduce_bytes
    if not (max(n, layout.efsdp if model.is_moe else 1) > 1 or s.mixed_precision != "fp32"):
        return 0.0, 0.0
    layer_local = numels["layer"][0] + (numels["experts"][0] if model.is_moe else 0)  # gathered at once
    layer_grad = layer_local
    head_local = numels.get("root" if model.tied_embeddings else "final", (0, 0))[0]
    head_grad = head_local
    if s.lora_r:  # the adapters are gathered with their layer; only they get gradients
        layer_grad = adapter_layer_local(model, s.lora_r, layout.tp)
        layer_local += layer_grad
        head_grad = 0
        if head_copy_trains(model, s.lora_saved):
            head_grad = model.vocab * model.hidden  # its trained copy: gathered beside the frozen table
            head_local += head_grad
    buf_a = head_local * cb
    prefetched = min(s.prefetch, model.layers - 1)  # a one-layer pipeline stage has no next layer
    # The reduce-scatter input FSDP2 holds is the previous unit's until this unit's own is made
    # (``reduce_scatter_states``): at the last layer's backward an untied head unit's.
    rs_input = max(layer_grad, 0 if model.tied_embeddings else head_grad)
    buf_b = (1 + prefetched) * layer_local * cb + layer_grad * e + (0 if accumulating else rs_input * rb)
    if model.tied_embeddings:
        buf_b += head_local * cb + head_grad * e
    if not s.reshard_after_forward or not s.reshard_after_backward:
        # every layer gathered at a layer's backward: kept from forward, or (a pipeline stage root,
        # ``reshard_after_backward`` False) since the previous micro-batch's backward
        kept = (model.layers - 1 - prefetched) * layer_local * cb
        buf_b += max(kept, 0.0)
    if not s.reshard_after_forward:
        buf_a += model.layers * layer_local * cb
    return buf_a, buf_b


def optimizer_step_temporaries(model: ModelSpec, layout: Layout, s: Settings) -> float:
    """Bytes unfused AdamW allocates during its step: two fp32 temporaries the size of the rank's
    largest parameter tensor (``sqrt(v)`` and its quotient). Measured: on the H200 the foreach step
    of Llama-3.2-1B peaked 1.96 GiB above its states (``bench/reference/h200_plan_gpu_check.json``,
    row 1b-mb4-foreach) = 2 × its 128256 × 2048 embedding; on CPU the per-tensor loop 2 × the
    largest shard (``ndparallel simulate``). Fused AdamW (the trainer's on CUDA) and SGD: none."""
    if s.optimizer == "muon":
        return muon_cost.step_temporaries(model, layout)
    if s.optimizer != "adamw" or s.optimizer_fused:
        return 0.0
    return 2 * 4.0 * _largest_shard(model, layout.tp, layout.fsdp)


@lru_cache(maxsize=4096)
def _largest_shard(model: ModelSpec, tp: int, fsdp: int) -> float:
    """Elements of the rank's largest parameter shard (cached: asked once per option)."""
    return max(p.numel / (tp if p.tp_dim is not None else 1) / fsdp for p in model.param_specs())


def _lora_state(model: ModelSpec, layout: Layout, s: Settings, shard_numel: float, head: str) -> tuple:
    """LoRA: (params, optimizer, all_grads, head_grads) bytes per GPU: the frozen base in the compute
    dtype, only the adapters (and the ``lora_modules_to_save`` copies) trained."""
    adapter_local = adapter_layer_local(model, s.lora_r, layout.tp)
    adapter = adapter_shard_numel(model, layout, s.lora_r)
    params = shard_numel * s.param_compute_bytes + adapter * 4
    optimizer = adapter * s.optimizer_state_bytes
    all_grads = adapter * 4 + (
        model.layers * adapter_local * s.reduce_bytes if s.accumulates_unsharded else 0.0
    )
    head_grads = 0.0  # the LM head is frozen
    copies = saved_copy_units(model, s.lora_saved)  # lora_modules_to_save: trained full tables
    if copies:
        copy = saved_copy_shard_numel(model, layout)
        params += len(copies) * copy * 4
        optimizer += len(copies) * copy * s.optimizer_state_bytes
        all_grads += len(copies) * copy * 4
        head_grads = copy * 4 if head in copies else 0.0
    return params, optimizer, all_grads, head_grads


def estimate_memory(model: ModelSpec, layout: Layout, s: Settings, hw: Hardware) -> MemoryBreakdown:
    """Peak bytes per GPU: the largest of the loss-backward moment, the first layer's backward,
    the end of backward (all gradients) and the optimizer step (its temporaries)."""
    t, n = layout.tp, layout.fsdp
    numels = unit_numels(model, t, n, layout)
    col = 1  # the shard; unsharded (a degree of 1) it is the whole tp-local tensor
    units = fsdp_units(model)
    shard_numel = sum(numels[u][col] * c for u, (c, _) in units.items())
    params = shard_numel * 4  # fp32 master weights
    optimizer = shard_numel * s.optimizer_state_bytes
    if s.optimizer == "muon":  # AdamW's two moments on the embedding / head units (plan/muon_cost.py)
        optimizer += muon_cost.adamw_extra_state_bytes(numels, units, col)
    all_grads = shard_numel * 4
    unsharded = 0.0
    if s.accumulates_unsharded:  # FSDP2 keeps unsharded grads in the reduce dtype between syncs
        unsharded = sum(numels[u][0] * c for u, (c, _) in units.items()) * s.reduce_bytes
        all_grads += unsharded
    head = "root" if model.tied_embeddings else "final"
    head_grads = 0.0 if model.tied_embeddings else numels.get(head, (0, 0))[col] * 4
    if s.lora_r:  # the frozen base stays in the compute dtype; only the adapters train (adapter.py)
        params, optimizer, all_grads, head_grads = _lora_state(model, layout, s, shard_numel, head)
    nf4 = memory_adjustments(model, layout, s, numels["layer"][0]) if s.quantized_base else {}
    params -= nf4.get("params", 0.0)  # QLoRA: the decoder linears are 4-bit NF4 (plan/qlora.py)
    # With zero_grad(set_to_none=True) and one micro-batch no gradient exists at the loss moment;
    # at the first layer's backward only the (untied) head unit's has been reduced.
    grads_kept = not s.set_to_none or s.grad_accum > 1
    grads_a = all_grads if grads_kept else 0.0
    grads_b = all_grads if grads_kept else head_grads
    if unsharded and not s.lora_r:  # accumulating unsharded: no sharded gradient before the sync
        grads_a = grads_b = unsharded + (0.0 if s.set_to_none else shard_numel * 4)

    dims = layout if model.is_moe else (layout.cp, layout.tp)
    saved, plain_layer, per_layer, qat_layer, qat_head, logits, workspace = _MICRO_BATCH.get(
        (model, dims, micro_batch_key(s)), lambda: _micro_batch_terms(model, layout, s)
    )
    # a pp stage's received inputs (offloaded, the stage keeps them) and its outputs (pipeline.py)
    held = stage_outputs_held(model, layout, s)
    held += stage_inputs_held(model, layout, s) if offloading(s) else 0
    saved += held * s.micro_batch * s.seq_len / layout.cp * checkpointed_input_per_token(model, layout, s)
    saved *= s.pp_in_flight  # a pipeline rank holds several micro-batches (plan/pipeline.py)
    if offloading(s) and s.recompute == "full":  # the offloader's copies in flight: a bound per rank
        copies = device_checkpointed_layers(model, s) * s.micro_batch * s.seq_len / layout.cp
        saved -= (s.pp_in_flight - 1) * copies * checkpointed_input_per_token(model, layout, s)
    buf_a, buf_b = _buffers(model, layout, s, numels, unsharded > 0)
    buf_a, buf_b = buf_a - nf4.get("buffer_a", 0.0), buf_b - nf4.get("buffer_b", 0.0)

    table_grad = 0.0 if s.lora_r else embedding_shard_grad_bytes(model, numels)  # not made yet
    moments = {
        "loss backward": (grads_a, saved + qat_head, logits, buf_a),
        # the last layer's backward: every layer's saved activations (under checkpointing, the
        # layer's own recomputed ones too) and the gradient workspace of one layer
        "layer backward": (
            grads_b,
            saved
            + (per_layer if s.checkpointing else 0.0)
            + workspace
            + nf4.get("workspace", 0.0)
            + (qat_layer if s.checkpointing else 0.0),
            0.0,
            buf_b,
        ),
        "end of backward": (all_grads, 0.0, 0.0, 0.0),
        # the table's own sharded gradient does not exist yet: it is what this backward makes; a
        # first pipeline stage's other micro-batches in flight keep their saved activations
        "embedding backward": (
            grads_b if unsharded and not s.lora_r else all_grads - table_grad,
            saved * (1.0 - 1.0 / s.pp_in_flight) if model.has_embedding else 0.0,
            0.0,
            embedding_backward_bytes(model, layout, s, numels)
            + kept_gathered_bytes(model, layout, s, numels),
        ),
        "optimizer step": (all_grads + optimizer_step_temporaries(model, layout, s), 0.0, 0.0, 0.0),
    }
    phase = max(moments, key=lambda k: sum(moments[k]))
    grads, acts, lg, buf = moments[phase]
    overhead = hw.runtime_overhead_bytes + FRAGMENTATION * (acts + lg + buf)
    total = params + grads + optimizer + acts + lg + buf + overhead
    parts = (params, grads, optimizer, acts, lg, buf, overhead, total)
    return MemoryBreakdown(*parts, phase, plain_layer, host_bytes(model, layout, s))


_MICRO_BATCH = Memo()


def _micro_batch_terms(model: ModelSpec, layout: Layout, s: Settings) -> tuple:
    """What one micro-batch's tokens hold: ``_saved_activations`` (one micro-batch in flight), the
    logits and the layer backward's workspace (with selective checkpointing and offloading, the
    layer's offloaded set back on the device for its backward). Memoised on a dense model's
    (cp, tp) and the settings less their step-level fields (``compute.micro_batch_key``): the search
    asks for the same micro-batch under every layout that shares them."""
    tokens = s.micro_batch * s.seq_len / layout.cp
    logits = _logits_bytes(model, layout, s, tokens) if model.has_lm_head else 0.0
    workspace = _workspace(model, layout, s, tokens)
    if s.recompute == "selective":
        workspace += offloaded_layer_bytes(model, layout, s)  # 0 without offloading
    return (*_saved_activations(model, layout, s, tokens), logits, workspace)


def _saved_activations(model: ModelSpec, layout: Layout, s: Settings, tokens: float) -> tuple:
    """(saved for backward at the peak with one micro-batch in flight, one layer's plain saved
    set, the same less what the tiled MLP drops, QAT's share per layer, QAT's share of the head),
    bytes of ``tokens`` per micro-batch."""
    e = s.act_bytes
    plain_layer = layer_activation_bytes_per_token(model, layout, s) * tokens
    per_layer = plain_layer - tiled_saved_reduction_per_token(model, layout, s) * tokens
    if s.recompute == "selective" and offloading(s):  # the residue stays on the device
        saved = model.layers * tokens * offload_split_per_token(model, layout, s)[0]
    elif s.recompute == "selective":
        saved = model.layers * tokens * selective_saved_per_token(model, layout, s)
    elif s.recompute == "op":
        saved = model.layers * tokens * op_policy_saved_per_token(model, layout, s)
    elif s.checkpointing:  # each layer's input only (with offloading: the ones on the device)
        saved = device_checkpointed_layers(model, s) * tokens * checkpointed_input_per_token(model, layout, s)
    else:
        saved = model.layers * per_layer
    # QAT: each layer's fake-quantiser share until its backward; under checkpointing one layer's,
    # while it is recomputed (plan/qat_memory.py). The head's is held until the loss backward.
    qat_layer = qat_head = 0.0
    if s.qat:
        qat_layer = qat_layer_bytes(model, s.qat, tokens, frozen=bool(s.lora_r), compute_bytes=e)
        qat_head = qat_head_bytes(model, s.qat, tokens, frozen=bool(s.lora_r), compute_bytes=e)
        saved += 0.0 if s.checkpointing else model.layers * qat_layer
    # RoPE cos and sin (b, s/c, d) in activation dtype, shared by all layers.
    saved += 2 * tokens * model.head_dim * e
    return saved, plain_layer, per_layer, qat_layer, qat_head


def _workspace(model: ModelSpec, layout: Layout, s: Settings, tokens: float) -> float:
    """One layer's backward workspace: the largest of its MLP stage (with the tiled MLP: per tile
    only), its post-attention RMSNorm's backward (``norm_backward_stage``) and its attention
    stage (CP buffers, less the MLP half's saved tensors, freed by then:
    ``mlp_half_saved_per_token``), each with the residual-stream gradients."""
    per_token = layer_backward_workspace_per_token(model, layout, s)
    mlp = mlp_gradient_workspace_per_token(model, layout, s)
    residual = tokens * (per_token - mlp)
    mlp_stage = tile_working_set(model, layout, s) if s.tiled_mlp else tokens * mlp
    attention_stage = tokens * (
        attention_scratch_per_token(model, layout, s) - mlp_half_saved_per_token(model, layout, s)
    )
    return residual + max(mlp_stage, norm_backward_stage(model, layout, s, tokens), attention_stage)
