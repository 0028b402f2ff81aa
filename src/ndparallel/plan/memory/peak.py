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

from ndparallel.layout.dims import ParallelDims
from ndparallel.plan import muon_cost
from ndparallel.plan.adapters.qlora import memory_adjustments
from ndparallel.plan.hardware import Hardware
from ndparallel.plan.memo import Memo
from ndparallel.plan.memory.activations import (
    backward_workspace,
    host_bytes,
    offloaded_layer_bytes,
    saved_activations,
)
from ndparallel.plan.memory.buffers import embedding_backward_bytes, fsdp_buffers, kept_gathered_bytes
from ndparallel.plan.memory.logits import logits_bytes
from ndparallel.plan.memory.long_context import (
    checkpointed_input_per_token,
    device_checkpointed_layers,
    offloading,
)
from ndparallel.plan.memory.states import embedding_shard_grad_bytes, lora_states, optimizer_step_temporaries
from ndparallel.plan.models import ModelSpec, fsdp_units
from ndparallel.plan.pipeline.schedule_model import stage_inputs_held, stage_outputs_held
from ndparallel.plan.settings import Settings
from ndparallel.plan.time.comms import unit_numels
from ndparallel.plan.time.compute import micro_batch_key

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


def estimate_memory(model: ModelSpec, layout: ParallelDims, s: Settings, hw: Hardware) -> MemoryBreakdown:
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
        params, optimizer, all_grads, head_grads = lora_states(model, layout, s, shard_numel, head)
    nf4 = memory_adjustments(model, layout, s, numels["layer"][0]) if s.load_in_4bit else {}
    params -= nf4.get("params", 0.0)  # QLoRA: the decoder linears are 4-bit NF4 (plan/adapters/qlora.py)
    # With zero_grad(set_to_none=True) and one micro-batch no gradient exists at the loss moment;
    # at the first layer's backward only the (untied) head unit's has been reduced.
    grads_kept = not s.set_to_none or s.gradient_accumulation_steps > 1
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
    saved += (
        held
        * s.micro_batch_size
        * s.sequence_len
        / layout.cp
        * checkpointed_input_per_token(model, layout, s)
    )
    saved *= s.pp_in_flight  # a pipeline rank holds several micro-batches (plan/pipeline/schedule_model.py)
    if offloading(s) and s.recompute == "full":  # the offloader's copies in flight: a bound per rank
        copies = device_checkpointed_layers(model, s) * s.micro_batch_size * s.sequence_len / layout.cp
        saved -= (s.pp_in_flight - 1) * copies * checkpointed_input_per_token(model, layout, s)
    buf_a, buf_b = fsdp_buffers(model, layout, s, numels, unsharded > 0)
    buf_a, buf_b = buf_a - nf4.get("buffer_a", 0.0), buf_b - nf4.get("buffer_b", 0.0)

    table_grad = 0.0 if s.lora_r else embedding_shard_grad_bytes(model, numels)  # not made yet
    moments = {
        "loss backward": (grads_a, saved + qat_head, logits, buf_a),
        # the last layer's backward: every layer's saved activations (under checkpointing, the
        # layer's own recomputed ones too) and the gradient workspace of one layer
        "layer backward": (
            grads_b,
            saved
            + (per_layer if s.activation_checkpointing else 0.0)
            + workspace
            + nf4.get("workspace", 0.0)
            + (qat_layer if s.activation_checkpointing else 0.0),
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


def _micro_batch_terms(model: ModelSpec, layout: ParallelDims, s: Settings) -> tuple:
    """What one micro-batch's tokens hold: ``saved_activations`` (one micro-batch in flight), the
    logits and the layer backward's workspace (with selective checkpointing and offloading, the
    layer's offloaded set back on the device for its backward). Memoised on a dense model's
    (cp, tp) and the settings less their step-level fields (``compute.micro_batch_key``): the search
    asks for the same micro-batch under every layout that shares them."""
    tokens = s.micro_batch_size * s.sequence_len / layout.cp
    logits = logits_bytes(model, layout, s, tokens) if model.has_lm_head else 0.0
    workspace = backward_workspace(model, layout, s, tokens)
    if s.recompute == "selective":
        workspace += offloaded_layer_bytes(model, layout, s)  # 0 without offloading
    return (*saved_activations(model, layout, s, tokens), logits, workspace)
