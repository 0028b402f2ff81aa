"""The embedding's backward, the last memory moment of a step (or of a first pipeline stage's
micro-batch): the table's gradients and, for a stage that keeps its layers gathered, those layers."""

from __future__ import annotations

from ndparallel.plan.layout import Layout, Settings
from ndparallel.plan.models import ModelSpec


def embedding_shard_grad_bytes(model: ModelSpec, numels: dict) -> float:
    """The embedding table's sharded fp32 gradient (0 on a rank without it)."""
    if not model.has_embedding:
        return 0.0
    return numels.get("root" if model.tied_embeddings else "embed", (0, 0))[1] * 4.0


def embedding_backward_bytes(model: ModelSpec, layout: Layout, s: Settings, numels: dict) -> float:
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


def kept_gathered_bytes(model: ModelSpec, layout: Layout, s: Settings, numels: dict) -> float:
    """A pipeline stage root that keeps its parameters gathered (``reshard_after_backward`` False)
    holds every layer unsharded at its embedding's backward (measured: PP 2 × FSDP 32, first stage,
    ``bench/simulate_heldout.py``); 0 where the layers are used unsharded as they are."""
    plain = layout.fsdp == 1 and s.mixed_precision == "fp32"
    if s.reshard_after_backward or not model.has_embedding or plain:
        return 0.0
    return model.layers * numels["layer"][0] * s.param_compute_bytes
