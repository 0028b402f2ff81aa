"""FSDP's buffers at each memory moment: the gathered (unsharded) parameters in the compute dtype and
the unsharded gradients of the units in use, and at the embedding's backward, the last moment of a
step (or of a first pipeline stage's micro-batch), the table's gradients and, for a stage that
keeps its layers gathered, those layers."""

from __future__ import annotations

from ndparallel.layout.dims import ParallelDims
from ndparallel.plan.adapters.lora_cost import (
    adapter_layer_local,
    head_copy_trains,
)
from ndparallel.plan.models import ModelSpec
from ndparallel.plan.settings import Settings


def fsdp_buffers(
    model: ModelSpec, layout: ParallelDims, s: Settings, numels: dict, accumulating: bool = False
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


def embedding_backward_bytes(model: ModelSpec, layout: ParallelDims, s: Settings, numels: dict) -> float:
    """The embedding's backward, the last of a step (or of a first pipeline stage's micro-batch):
    its table gathered (under FSDP or mixed precision) and the lookup's dense gradient, a whole
    (tp-local) table; tied (without pipeline parallel) also the LM head's gradient, kept by
    autograd until the lookup's arrives, and their sum — three unsharded gradients at once. 0 for
    a rank without the embedding or a frozen table (LoRA). Measured (``bench/simulate_heldout.py``,
    2026-12-06), without this moment: a tied 151,936 × 256 table at FSDP 128 peaked at 601 MiB
    where the planner had 383 (−36 %); the first stage of PP 2 × FSDP 32 (untied 50k × 384) at 176
    where it had 51 (−71 %)."""
    if not model.has_embedding or s.lora_r:
        return 0.0
    tied = model.tied_embeddings and model.has_lm_head and layout.pp == 1
    local = numels.get("root" if model.tied_embeddings else "embed", (0, 0))[0]
    sharded = max(layout.fsdp, 1) > 1 or s.mixed_precision != "fp32"
    return local * ((s.param_compute_bytes if sharded else 0) + (3 if tied else 1) * s.param_compute_bytes)


def kept_gathered_bytes(model: ModelSpec, layout: ParallelDims, s: Settings, numels: dict) -> float:
    """A pipeline stage root that keeps its parameters gathered (``reshard_after_backward`` False)
    holds every layer unsharded at its embedding's backward (measured: PP 2 × FSDP 32, first stage,
    ``bench/simulate_heldout.py``); 0 where the layers are used unsharded as they are."""
    plain = layout.fsdp == 1 and s.mixed_precision == "fp32"
    if s.reshard_after_backward or not model.has_embedding or plain:
        return 0.0
    return model.layers * numels["layer"][0] * s.param_compute_bytes
