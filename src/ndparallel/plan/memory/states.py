"""The states a rank keeps through the step: fp32 master parameters (the frozen base in the compute
dtype under LoRA), gradients, optimizer states, and what the optimizer step allocates besides."""

from __future__ import annotations

from functools import lru_cache

from ndparallel.layout.dims import ParallelDims
from ndparallel.plan import muon_cost
from ndparallel.plan.adapters.lora_cost import (
    adapter_layer_local,
    adapter_shard_numel,
    saved_copy_shard_numel,
    saved_copy_units,
)
from ndparallel.plan.models import ModelSpec
from ndparallel.plan.settings import Settings


def optimizer_step_temporaries(model: ModelSpec, layout: ParallelDims, s: Settings) -> float:
    """Bytes unfused AdamW allocates during its step: two fp32 temporaries the size of the rank's
    largest parameter tensor (``sqrt(v)`` and its quotient). Measured: on the H200 the foreach step
    of Llama-3.2-1B peaked 1.96 GiB above its states (``bench/reference/h200_plan_gpu_check.json``,
    row 1b-mb4-foreach) = 2 × its 128256 × 2048 embedding; on CPU the per-tensor loop 2 × the
    largest shard (``ndparallel simulate``). Fused AdamW (the trainer's on CUDA) and SGD: none."""
    if s.optimizer == "muon":
        return muon_cost.step_temporaries(model, layout)
    if s.optimizer != "adamw" or s.optimizer_fused:
        return 0.0
    return 2 * 4.0 * largest_shard(model, layout.tp, layout.fsdp)


@lru_cache(maxsize=4096)
def largest_shard(model: ModelSpec, tp: int, fsdp: int) -> float:
    """Elements of the rank's largest parameter shard (cached: asked once per option)."""
    return max(p.numel / (tp if p.tp_dim is not None else 1) / fsdp for p in model.param_specs())


def lora_states(model: ModelSpec, layout: ParallelDims, s: Settings, shard_numel: float, head: str) -> tuple:
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


def embedding_shard_grad_bytes(model: ModelSpec, numels: dict) -> float:
    """The embedding table's sharded fp32 gradient (0 on a rank without it)."""
    if not model.has_embedding:
        return 0.0
    return numels.get("root" if model.tied_embeddings else "embed", (0, 0))[1] * 4.0
