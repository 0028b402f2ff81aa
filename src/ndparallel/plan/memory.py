"""Peak memory per GPU of one layout: states, activations, FSDP buffers, logits, overhead.

Peak = persistent states + saved activations of all layers + the larger of two moments:
(A) the loss/LM-head backward (logits and loss tensors, LM-head unit unsharded, next layer
prefetched) and (B) one decoder layer's backward (its recomputed/working activations and
gradients, its all-gathered params plus prefetch, its unsharded gradient being reduced).
Derivations and sources: docs/planner.md.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from ndparallel.plan.adapter import adapter_layer_local, adapter_shard_numel
from ndparallel.plan.comms import unit_numels
from ndparallel.plan.hardware import Hardware
from ndparallel.plan.layout import Layout, Settings
from ndparallel.plan.models import ModelSpec, fsdp_units

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

    def to_dict(self) -> dict:
        return asdict(self)


def layer_activation_bytes_per_token(model: ModelSpec, layout: Layout, s: Settings) -> float:
    """Bytes one decoder layer keeps for backward per local token (no checkpointing).

    Per token (h hidden, d head dim, a/k q/kv heads, f MLP width, t = tp, t_sp = tp with
    sequence parallel else 1, e = activation bytes):
      2 RMSNorms, each fp32 input + normalized output
      + its fp32 reciprocal RMS (one per token):         2·((4+e)·h + 4) / t_sp
      q/k/v input and MLP input (gathered under SP):     2·e·h
      q, k, v after RoPE kept by attention:              e·(a+2k)·d / t
      attention output (also o_proj input):              e·a·d / t
      log-sum-exp:                                       4·a / t
      gate, SiLU(gate), up, product (down_proj input):   4·e·f / t
      (Qwen3 q/k RMSNorms:                               (4+e)·(a+k)·d / t + 4·(a+k) / t)
    """
    h, d, a, k, f = model.hidden, model.head_dim, model.heads, model.kv_heads, model.intermediate
    t = layout.tp
    t_sp = t if s.sequence_parallel else 1
    e = s.act_bytes
    per = 2 * ((4 + e) * h + 4) / t_sp + 2 * e * h
    per += e * (a + 2 * k) * d / t + e * a * d / t + 4 * a / t + 4 * e * f / t
    if model.qk_norm:
        per += ((4 + e) * d + 4) * (a + k) / t
    return per


def estimate_memory(model: ModelSpec, layout: Layout, s: Settings, hw: Hardware) -> MemoryBreakdown:
    t, n = layout.tp, layout.fsdp
    e, cb, rb = s.act_bytes, s.param_compute_bytes, s.reduce_bytes
    numels = unit_numels(model, t, n)
    # Unsharded (n == 1) a rank holds the whole tp-local tensors.
    col = 1 if n > 1 else 0
    shard_numel = sum(numels[u][col] * c for u, (c, _) in fsdp_units(model).items())
    # Persistent: fp32 sharded params (master weights), fp32 sharded grads, optimizer states.
    params = shard_numel * 4
    grads = shard_numel * 4
    if s.accumulates_unsharded:  # FSDP2 keeps unsharded grads in the reduce dtype between syncs
        grads += sum(numels[u][0] * c for u, (c, _) in fsdp_units(model).items()) * rb
    optimizer = shard_numel * s.optimizer_state_bytes
    layer_grad, head_grad, adapter_local = numels["layer"][0], None, 0
    if s.lora_r:  # the frozen base stays in the compute dtype; only the adapters train
        adapter_local = adapter_layer_local(model, s.lora_r, t)
        adapter = adapter_shard_numel(model, layout, s.lora_r)
        params = shard_numel * s.param_compute_bytes + adapter * 4
        grads = adapter * 4 + (model.layers * adapter_local * rb if s.accumulates_unsharded else 0)
        optimizer = adapter * s.optimizer_state_bytes
        layer_grad, head_grad = adapter_local, 0

    # Activations.
    tokens = s.micro_batch * s.seq_len / layout.cp
    t_sp = t if s.sequence_parallel else 1
    per_layer = layer_activation_bytes_per_token(model, layout, s) * tokens
    if s.checkpointing:
        saved = model.layers * tokens * e * model.hidden / t_sp  # each layer's input only
    else:
        saved = model.layers * per_layer
    # RoPE cos and sin (b, s/c, d) in activation dtype, shared by all layers (full local
    # sequence under SP: attention runs on the gathered sequence).
    saved += 2 * tokens * model.head_dim * e
    working = per_layer  # one layer's recomputed / gradient working set during its backward

    # Logits and loss (vocab sharded over tp by loss parallel), final norm + LM-head input.
    # Per logit: the logits (e), the fp32 log-softmax kept for backward, and in its backward
    # two fp32 gradients (nll, log-softmax) = e + 12; loss parallel's fused nll + log-softmax
    # backward (torch.distributed.tensor.parallel.loss) holds zeros_like(x), exp(x) and their
    # sum at once = e + 16.
    if s.loss_parallel and t > 1:
        logits = tokens * -(-model.vocab // t) * (e + 16)
    else:
        logits = tokens * model.vocab * (e + 12)
    logits += tokens * (((4 + e) * model.hidden + 4) / t_sp + e * model.hidden)

    # FSDP buffers: all-gathered (compute-dtype) params of the unit in use and prefetched ones,
    # and its unsharded gradient in compute dtype plus the fp32 copy fed to reduce-scatter.
    # LoRA: the adapters are gathered with their layer; only they have gradients.
    layer_local = numels["layer"][0] + adapter_local
    head_unit = "root" if model.tied_embeddings else "final"
    head_local = numels[head_unit][0]
    head_grad = head_local if head_grad is None else head_grad
    cast_needed = n > 1 or s.mixed_precision != "fp32"
    grad_buf = e + rb
    if cast_needed:
        buf_b = (1 + s.prefetch) * layer_local * cb + layer_grad * grad_buf
        buf_a = head_local * cb + head_grad * grad_buf + s.prefetch * layer_local * cb
        if model.tied_embeddings:  # the root unit stays unsharded through all of backward
            buf_b += head_local * cb
    else:
        buf_a = buf_b = 0.0

    extra_a = logits + buf_a
    extra_b = working + buf_b
    if extra_a >= extra_b:
        phase, acts, lg, buf = "loss backward", saved, logits, buf_a
    else:
        phase, acts, lg, buf = "layer backward", saved + working, 0.0, buf_b
    overhead = hw.runtime_overhead_bytes + FRAGMENTATION * (acts + lg + buf)
    total = params + grads + optimizer + acts + lg + buf + overhead
    return MemoryBreakdown(params, grads, optimizer, acts, lg, buf, overhead, total, phase,
                           per_layer)
