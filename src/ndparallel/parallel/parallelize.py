"""Apply the strategies to a model in one readable order: float8 → TP → CP → activation
checkpointing → compile → FSDP (torchtitan's order).

Each step is a call into one strategy module; this function only decides which apply.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from ndparallel.layout.config import ParallelismConfig
from ndparallel.layout.mesh import submesh
from ndparallel.parallel.options import (
    CompileOptions,
    CPOptions,
    Float8Options,
    FSDPOptions,
    TPOptions,
)


def is_meta(model: nn.Module) -> bool:
    return any(p.is_meta for p in model.parameters())


def parallelize_model(
    model: nn.Module,
    mesh: DeviceMesh,
    pc: ParallelismConfig,
    fsdp: FSDPOptions,
    tp: TPOptions,
    cp: CPOptions,
    param_dtype: torch.dtype | None,
    device: torch.device,
    compile: CompileOptions = CompileOptions(),
    float8: Float8Options = Float8Options(),
) -> nn.Module:
    """Parallelise ``model`` in place for layout ``pc`` on ``mesh`` and return it."""
    if not is_meta(model):
        model.to(device)
    use_fsdp = pc.dp_replicate_size * pc.fsdp_size > 1 or param_dtype is not None
    if float8.enabled:
        from ndparallel.parallel.float8 import apply_float8

        apply_float8(model, float8, fsdp.layer_classes, fsdp=use_fsdp)
    if pc.tp_enabled:
        from ndparallel.parallel import tensor

        tp_mesh = submesh(mesh, "tp")
        if tensor.is_tensor_parallel(model):  # made TP by transformers (tp_plan / device_mesh)
            tensor.distribute_leftover_params(model, tp_mesh)
        else:
            tensor.validate_tensor_parallel(model.config, pc.tp_size, tp)
            tensor.apply_tensor_parallel(model, tp_mesh, tp)
    if pc.cp_enabled:
        from ndparallel.parallel import context

        context.apply_context_parallel(model, submesh(mesh, "cp"), cp)
    if fsdp.activation_checkpointing:
        # transformers' own per-decoder-layer checkpointing (GradientCheckpointingLayer); the
        # non-reentrant variant composes with FSDP2's hooks and DTensor.
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if compile.enabled:
        from ndparallel.parallel.compile import apply_compile

        apply_compile(model, compile, fsdp.layer_classes, per_child=pc.tp_enabled)
    if use_fsdp:
        from ndparallel.parallel.fsdp import apply_fsdp

        dims = ("dp_replicate", "dp_shard_cp") if pc.dp_replicate_enabled else ("dp_shard_cp",)
        apply_fsdp(model, submesh(mesh, *dims), fsdp, param_dtype=param_dtype)
    return model
