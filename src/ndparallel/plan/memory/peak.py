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
from operator import attrgetter

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


MOMENTS = ("loss backward", "layer backward", "end of backward", "embedding backward", "optimizer step")
"""The moments whose largest is the peak (the module doc)."""


def estimate_memory(model: ModelSpec, layout: ParallelDims, s: Settings, hw: Hardware) -> MemoryBreakdown:
    """Peak bytes per GPU: the largest of the loss-backward moment, the first layer's backward,
    the end of backward (all gradients), the embedding's backward and the optimizer step (its
    temporaries). Each moment is the sum of the rank's states (``_state_terms``: parameters,
    gradients, optimizer, FSDP's buffers) and of one micro-batch's activations
    (``_activation_terms``), each memoised on what it reads: the search asks for the same states
    under every micro-batch and the same activations under every layout with the same (cp, tp)."""
    params, optimizer, state, nf4_workspace = _STATES.get(
        (model, layout, state_key(s), min(s.gradient_accumulation_steps, 2)),
        lambda: _state_terms(model, layout, s),
    )
    dims = layout if model.is_moe else (layout.cp, layout.tp)
    stages = s.pipeline_virtual_stages if layout.pp > 1 else 0
    acts, plain_layer, host = _ACTIVATIONS.get(
        (model, dims, micro_batch_key(s), s.pp_in_flight, stages),
        lambda: _activation_terms(model, layout, s),
    )
    phase, most = MOMENTS[0], -1.0
    for moment, (grads, buf), (saved, lg) in zip(MOMENTS, state, acts):
        if moment == "layer backward":
            saved += nf4_workspace
        total = grads + saved + lg + buf
        if total > most:
            phase, most, parts = moment, total, (grads, saved, lg, buf)
    grads, saved, lg, buf = parts
    overhead = hw.runtime_overhead_bytes + FRAGMENTATION * (saved + lg + buf)
    total = params + grads + optimizer + saved + lg + buf + overhead
    return MemoryBreakdown(
        params, grads, optimizer, saved, lg, buf, overhead, total, phase, plain_layer, host
    )


STATE_FIELDS = (
    "optimizer",
    "optimizer_fused",
    "mixed_precision",
    "lora_r",
    "lora_saved",
    "load_in_4bit",
    "prefetch",
    "reshard_after_forward",
    "reshard_after_backward",
    "set_to_none",
    "unsharded_grad_accumulation",
    "sync_every_microbatch",
)
state_key = attrgetter(*STATE_FIELDS)
"""The ``Settings`` fields ``_state_terms`` reads, but for the accumulation steps, of which it reads
only whether there are several (``tests/test_plan_memo.py``)."""
_STATES = Memo(65536)
_ACTIVATIONS = Memo(65536)


def _state_terms(model: ModelSpec, layout: ParallelDims, s: Settings) -> tuple:
    """(params, optimizer, (gradients, FSDP buffers) at each of ``MOMENTS``, QLoRA's dequantisation
    workspace at the layer's backward): the rank's states, whatever its micro-batch."""
    numels = unit_numels(model, layout.tp, layout.fsdp, layout)
    units = fsdp_units(model)
    params, optimizer, all_grads, head_grads, shard_numel = _states(model, layout, s, numels, units)
    unsharded = 0.0
    if s.accumulates_unsharded:  # FSDP2 keeps unsharded grads in the reduce dtype between syncs
        unsharded = sum(numels[u][0] * c for u, (c, _) in units.items()) * s.reduce_bytes
        all_grads += 0.0 if s.lora_r else unsharded  # LoRA's: in lora_states
    nf4 = memory_adjustments(model, layout, s, numels["layer"][0]) if s.load_in_4bit else {}
    params -= nf4.get("params", 0.0)  # QLoRA: the decoder linears are 4-bit NF4 (plan/adapters/qlora.py)
    # With zero_grad(set_to_none=True) and one micro-batch no gradient exists at the loss moment;
    # at the first layer's backward only the (untied) head unit's has been reduced.
    grads_kept = not s.set_to_none or s.gradient_accumulation_steps > 1
    grads_a = all_grads if grads_kept else 0.0
    grads_b = all_grads if grads_kept else head_grads
    if unsharded and not s.lora_r:  # accumulating unsharded: no sharded gradient before the sync
        grads_a = grads_b = unsharded + (0.0 if s.set_to_none else shard_numel * 4)
    buf_a, buf_b = fsdp_buffers(model, layout, s, numels, unsharded > 0)
    buf_a, buf_b = buf_a - nf4.get("buffer_a", 0.0), buf_b - nf4.get("buffer_b", 0.0)
    table_grad = 0.0 if s.lora_r else embedding_shard_grad_bytes(model, numels)  # not made yet
    state = (
        (grads_a, buf_a),  # loss backward: the head unit gathered
        (grads_b, buf_b),  # the last layer's backward: one layer gathered (and prefetch)
        (all_grads, 0.0),  # end of backward
        # the table's own sharded gradient does not exist yet: it is what this backward makes
        (
            grads_b if unsharded and not s.lora_r else all_grads - table_grad,
            embedding_backward_bytes(model, layout, s, numels)
            + kept_gathered_bytes(model, layout, s, numels),
        ),
        (all_grads + optimizer_step_temporaries(model, layout, s), 0.0),  # optimizer step
    )
    return params, optimizer, state, nf4.get("workspace", 0.0)


def _activation_terms(model: ModelSpec, layout: ParallelDims, s: Settings) -> tuple:
    """((saved activations, logits) at each of ``MOMENTS``, one layer's plain saved set, host bytes
    of offloading): one micro-batch's tokens under the rank's micro-batches in flight, whatever its
    states."""
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
    recomputed = (per_layer + qat_layer) if s.activation_checkpointing else 0.0
    acts = (
        (saved + qat_head, logits),
        # the last layer's backward: every layer's saved activations (under checkpointing, the
        # layer's own recomputed ones too) and the gradient workspace of one layer
        (saved + recomputed + workspace, 0.0),
        (0.0, 0.0),
        # a first pipeline stage's other micro-batches in flight keep their saved activations
        (saved * (1.0 - 1.0 / s.pp_in_flight) if model.has_embedding else 0.0, 0.0),
        (0.0, 0.0),
    )
    return acts, plain_layer, host_bytes(model, layout, s)


def resident_bytes(model: ModelSpec, layout: ParallelDims, s: Settings, hw: Hardware) -> float:
    """What ``estimate_memory``'s peak holds at least whatever the micro-batch, checkpointing,
    offloading, resharding or gradient accumulation: the parameters (less QLoRA's NF4 saving), the
    optimizer states and the runtime's own memory, held at every moment, and the sharded gradients
    the end of backward holds (more when accumulated unsharded). A lower bound of its ``total``:
    the search skips an option whose ``resident_bytes`` exceed the device
    (``plan/search/bounds.py``)."""
    numels = unit_numels(model, layout.tp, layout.fsdp, layout)
    params, optimizer, grads, *_ = _states(model, layout, s, numels, fsdp_units(model))
    if s.load_in_4bit:
        params -= memory_adjustments(model, layout, s, numels["layer"][0])["params"]
    return params + optimizer + grads + hw.runtime_overhead_bytes


def _states(model: ModelSpec, layout: ParallelDims, s: Settings, numels: dict, units: dict) -> tuple:
    """(params, optimizer, sharded gradients, the head unit's gradient, shard elements) bytes: fp32
    master weights, optimizer states and gradients of the rank's shard (under LoRA the frozen base in
    the compute dtype and the adapters' states, with their unsharded accumulation: ``lora_states``)."""
    col = 1  # the shard; unsharded (a degree of 1) it is the whole tp-local tensor
    shard_numel = sum(numels[u][col] * c for u, (c, _) in units.items())
    optimizer = shard_numel * s.optimizer_state_bytes
    if s.optimizer == "muon":  # AdamW's two moments on the embedding / head units (plan/muon_cost.py)
        optimizer += muon_cost.adamw_extra_state_bytes(numels, units, col)
    head = "root" if model.tied_embeddings else "final"
    head_grads = 0.0 if model.tied_embeddings else numels.get(head, (0, 0))[col] * 4
    if s.lora_r:  # the frozen base stays in the compute dtype; only the adapters train (adapter.py)
        return (*lora_states(model, layout, s, shard_numel, head), shard_numel)
    return shard_numel * 4, optimizer, shard_numel * 4, head_grads, shard_numel


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
