"""Apply the strategies to a model in one readable order: float8 or QAT fake quantisation → TP → EP →
CP → tiled MLP + lean norms → activation checkpointing (+ offloading) → compile → FSDP (torchtitan's
order).
This is the one statement of that order: the engine, the Accelerate facade and the docs refer here.

Each step is a call into one strategy module; this function only decides which apply.

Device memory: a model built on the CPU is never moved to the device whole. TP moves each parameter
as it shards it, FSDP each module as it shards it (one unsharded layer at a time on the device),
and only what no strategy took (e.g. a one-device run, buffers) is moved at the end. So the peak
device memory of ``prepare`` is about model/N + one layer. Under FSDP CPU offload the sharded
parameters stay in host memory.
Master weights are fp32: a bf16/fp16 model is upcast module by module as it is sharded (a warning
says so); compute runs in the ``mixed_precision`` dtype. Frozen parameters (a LoRA base model) keep
their dtype: a base loaded in bf16 stays bf16, sharded like the rest.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from ndparallel.layout.dims import ParallelDims
from ndparallel.layout.mesh import submesh
from ndparallel.models.adapters import base_model_of
from ndparallel.models.quantized import nf4_layout_problem
from ndparallel.parallel.cp.context import apply_context_parallel
from ndparallel.parallel.ep.expert import apply_expert_parallel
from ndparallel.parallel.fsdp import apply_fsdp
from ndparallel.parallel.layout_refusals import qat_layout_problem
from ndparallel.parallel.options import ActivationOptions, StrategyOptions
from ndparallel.parallel.support import layout_problem
from ndparallel.parallel.tp.tensor import apply_tensor_parallel, is_tensor_parallel
from ndparallel.techniques.compile import apply_compile
from ndparallel.techniques.float8 import apply_float8
from ndparallel.techniques.lean_norm import apply_lean_norms
from ndparallel.techniques.master_weights import low_precision_params, upcast_params
from ndparallel.techniques.offload import ActivationOffloader, apply_activation_offloading
from ndparallel.techniques.qat import apply_qat
from ndparallel.techniques.selective_ac import (
    apply_activation_checkpointing,
    is_selective,
    selective_policy_problem,
)
from ndparallel.techniques.tiled_mlp import apply_tiled_mlp, check_not_fsdp_unit, is_tiled


def is_meta(model: nn.Module) -> bool:
    return any(p.is_meta for p in model.parameters())


def uses_fsdp(dims: ParallelDims, options: StrategyOptions, experts_split: bool = False) -> bool:
    """FSDP2 wraps the model when parameters are sharded or replicated over ranks, and for mixed
    precision on one rank too (its ``MixedPrecisionPolicy`` does the casts); with the experts
    split off (``parallel/ep/expert.py``) also when only they are sharded (over ``efsdp``)."""
    sharded = dims.dp_replicate * dims.fsdp > 1 or (experts_split and dims.efsdp > 1)
    return sharded or options.param_dtype is not None


def parallelize_model(
    model: nn.Module,
    mesh: DeviceMesh,
    dims: ParallelDims,
    options: StrategyOptions,
    device: torch.device,
    master_dtype: torch.dtype | None = torch.float32,
    expert_mesh: DeviceMesh | None = None,
    offloader: ActivationOffloader | None = None,
) -> nn.Module:
    """Parallelise ``model`` in place for layout ``dims`` on ``mesh`` and return it. ``master_dtype``:
    the dtype trainable parameters (and optimizer states) are kept in; None keeps the model's own.
    A PEFT model is parallelised through the Hugging Face model inside it (LoRA layers included).
    ``expert_mesh`` (``layout.mesh.build_expert_mesh``): given, the experts of a mixture-of-experts
    model are split over its ``ep`` dim and FSDP-sharded over its ``efsdp`` dim (``dims.experts_split``).
    ``offloader``: the activation offloader to share (a rank's pipeline stages share one host budget)."""
    wrapper, model = model, base_model_of(model)
    problem = nf4_layout_problem(model, dims.fsdp, dims.tp)  # QLoRA's 4-bit base
    if problem:
        raise ValueError(problem)
    upcast = master_dtype if master_dtype is not None and low_precision_params(model, master_dtype) else None
    if upcast is not None:
        warnings.warn(
            f"the model's trainable parameters are "
            f"{next(p.dtype for p in model.parameters() if p.requires_grad and p.is_floating_point())}: "
            f"upcasting them to {upcast} master weights (compute uses mixed_precision's dtype); "
            "load the model in float32 to skip this step",
            stacklevel=3,
        )
    fsdp = options.fsdp
    _check_layout(model, dims, options.tp)
    if options.float8.enabled:
        apply_float8(model, options.float8, fsdp.layer_classes, fsdp=uses_fsdp(dims, options))
    if options.qat.enabled:
        problem = qat_layout_problem(dims.tp, options.float8.enabled)
        if problem:
            raise ValueError(problem)
        apply_qat(model, options.qat)
    if dims.tp_enabled:
        apply_tensor_parallel(model, submesh(mesh, "tp"), options.tp, adapted=wrapper is not model)
    experts = []
    if expert_mesh is not None:
        tp_mesh = submesh(mesh, "tp") if dims.tp_enabled else None
        experts = apply_expert_parallel(model, expert_mesh["ep"], tp_mesh, options.tp.sequence_parallel)
    if dims.cp_enabled:
        apply_context_parallel(model, submesh(mesh, "cp"), options.cp)
    activation = options.activation
    problem = selective_policy_problem(activation, compiled=options.compile.enabled)
    if problem:
        raise ValueError(problem)
    apply_activation_memory(model, activation, device, offloader, fsdp.layer_classes)
    if options.compile.enabled:
        # the tiled MLP's nested backward and the offloading hooks stay eager: compile each child
        apply_compile(
            model,
            options.compile,
            fsdp.layer_classes,
            per_child=dims.tp_enabled or activation.tiled_mlp or activation.activation_offloading,
            skip_attention=dims.cp_enabled and activation.activation_checkpointing,
            eager=is_tiled if dims.tp_enabled and activation.tiled_mlp else None,  # techniques/compile.py
        )
    if uses_fsdp(dims, options, bool(experts)):
        expert_fsdp = (expert_mesh[dims.expert_fsdp_dims()], experts) if experts else None
        apply_fsdp(
            model,
            submesh(mesh, *dims.fsdp_dims),
            fsdp,
            param_dtype=options.param_dtype,
            master_dtype=upcast,
            experts=expert_fsdp,
        )
        if activation.tiled_mlp:
            check_not_fsdp_unit(model)
    elif upcast is not None:
        upcast_params(model, upcast)
    move_leftovers(model, device, keep_params_on_cpu=fsdp.cpu_offload)
    return wrapper


def _check_layout(model: nn.Module, dims: ParallelDims, tp) -> None:
    """Refuse (one line, before any sharding) what this model cannot run exactly under ``dims``."""

    made_tp = dims.tp > 1 and is_tensor_parallel(model)  # by transformers: its own plan applied
    problem = layout_problem(
        model,
        tp_size=1 if made_tp else dims.tp,
        cp_size=dims.cp,
        tp=tp,
        probe_attention=False,
        ep_size=dims.ep,
    )
    if problem:
        raise ValueError(problem)


def apply_activation_memory(
    model: nn.Module,
    activation: ActivationOptions,
    device: torch.device,
    offloader: ActivationOffloader | None = None,
    layer_classes: tuple[str, ...] | None = None,
) -> None:
    """The per-decoder-layer memory options, after TP and CP (their hooks stay on the blocks):
    sequence-tiled MLP and lean norms (``tiled_mlp``), activation checkpointing, then offloading of
    what it keeps (the checkpointed inputs; under the selective policy all a layer saves).
    ``layer_classes``: the decoder layers' class names (``FSDPOptions.layer_classes``)."""
    if activation.activation_offloading and not activation.activation_checkpointing:
        raise ValueError(
            "activation_offloading offloads the inputs activation checkpointing keeps: set "
            "fsdp_config.activation_checkpointing: true (ActivationOptions(activation_checkpointing=True))"
        )
    problem = selective_policy_problem(activation)  # before anything changes the model
    if problem:
        raise ValueError(problem)
    if activation.tiled_mlp:
        apply_tiled_mlp(model, activation.tiled_mlp_num_shards, layer_classes)
        apply_lean_norms(
            model, activation.tiled_mlp_num_shards
        )  # HF-Llama-form RMSNorms, token-tiled backward
    apply_activation_checkpointing(model, activation, layer_classes)  # full, or norms + MLP activation
    if activation.activation_offloading:
        selective = is_selective(activation)
        apply_activation_offloading(model, device, layer_classes, selective, offloader)


def move_leftovers(model: nn.Module, device: torch.device, keep_params_on_cpu: bool = False) -> None:
    """Move what no strategy moved (all of a one-device model, buffers) to ``device``; meta
    tensors stay (``load_model`` materialises them), offloaded parameters stay on the CPU."""
    with torch.no_grad():
        for module in model.modules():
            for name, b in module.named_buffers(recurse=False):
                if b is not None and not b.is_meta and b.device != device:
                    module._buffers[name] = b.to(device)
            if keep_params_on_cpu:
                continue
            for p in module.parameters(recurse=False):
                if not p.is_meta and p.device != device:
                    torch.utils.swap_tensors(
                        p, nn.Parameter(p.detach().to(device), requires_grad=p.requires_grad)
                    )
