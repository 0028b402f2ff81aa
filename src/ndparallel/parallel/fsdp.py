"""FSDP2 (``fully_shard``) over ``dp_shard_cp``, HSDP over (``dp_replicate``, ``dp_shard_cp``).

One strategy covers pure replication, FSDP and HSDP: ``fully_shard`` on the 2-D mesh
(dp_replicate, dp_shard_cp) shards over the second dim and all-reduces over the first, so DP
(shard size 1), FSDP (replicate size 1) and HSDP use the same, tested, code path.
Gradients are *summed* across ranks (divide factor 1): the training loss is already normalised
by the global number of loss tokens, so averaging again would make gradients depend on the layout.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    fully_shard,
)

from ndparallel.models.layers import decoder_layers, embedding_modules, output_modules
from ndparallel.models.naming import share_parameters
from ndparallel.models.quantized import is_nf4
from ndparallel.parallel.options import FSDPOptions
from ndparallel.techniques.master_weights import upcast_params


def apply_fsdp(
    model: nn.Module,
    dp_mesh: DeviceMesh,
    options: FSDPOptions,
    param_dtype: torch.dtype | None = None,
    master_dtype: torch.dtype | None = None,
    experts: tuple[DeviceMesh, list[nn.Module]] | None = None,
) -> nn.Module:
    """Shard ``model`` with FSDP2: each decoder layer, the embeddings, the final norm + lm_head, then
    the root. ``dp_mesh`` is 1-D (shard) or 2-D (replicate, shard). ``param_dtype`` (e.g. bf16) is
    the compute dtype; gradients are reduced in ``options.reduce_dtype`` (default fp32) and the
    sharded fp32 master weights are kept. ``master_dtype``: upcast each module's parameters to it
    just before sharding that module, so only one module at a time exists unsharded in the higher
    precision. ``experts``: (expert FSDP mesh, experts modules split off by ``parallel/ep/expert.py``):
    each becomes its own FSDP unit on that mesh (``efsdp``, with ``dp_replicate`` for HSDP) inside
    its decoder layer's unit, as torchtitan shards experts over ``efsdp``."""
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=options.reduce_dtype or torch.float32)
    kwargs = dict(mesh=dp_mesh, mp_policy=mp)
    if options.cpu_offload:
        # Pinned host memory needs an accelerator; on a CPU-only run offloading is a no-op copy.
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
    nf4 = {p for p in model.parameters() if is_nf4(p)}
    if nf4 and dp_mesh.size(dp_mesh.ndim - 1) == 1:
        # QLoRA without sharding (DP, or one device with mixed precision): FSDP2's shard-size-1 path
        # has no room for NF4's three all-gather inputs. The frozen NF4 weights are replicated as
        # they are (no gradient, nothing to reduce); FSDP keeps the rest.
        kwargs["ignored_params"] = nf4

    def shard(module, reshard_after_forward: bool) -> None:
        for m in module if isinstance(module, list) else [module]:
            if master_dtype is not None:
                upcast_params(m, master_dtype)
        fully_shard(module, reshard_after_forward=reshard_after_forward, **kwargs)

    if experts is not None:
        expert_mesh, modules = experts
        for module in modules:
            if master_dtype is not None:
                upcast_params(module, master_dtype)
            fully_shard(
                module,
                reshard_after_forward=options.reshard_after_forward,
                shard_placement_fn=_expert_placement(module, expert_mesh),
                **{**kwargs, "mesh": expert_mesh},
            )
    for layer in decoder_layers(model, options.layer_classes):
        shard(layer, options.reshard_after_forward)
    embeddings = embedding_modules(model)
    if embeddings and not share_parameters(embeddings, output_modules(model)):
        for module in embeddings:
            shard(module, options.reshard_after_forward)
        # The output group is used last in forward and first in backward: keep it gathered.
        shard(output_modules(model), reshard_after_forward=False)
    shard(model, reshard_after_forward=False)
    model.register_forward_hook(_reshard_after_no_grad_forward)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            # Plain SUM collectives: gloo has no PREMUL_SUM, and NCCL's zero-copy path wants SUM.
            module.set_force_sum_reduction_for_comms(True)
    return model


def _expert_placement(module: nn.Module, expert_mesh: DeviceMesh):
    """Shard experts on dim 0 (whole experts per rank) unless there are fewer local experts than
    ``efsdp`` ranks: then on dim 1, which needs no padding (torchtitan's rule)."""
    from torch.distributed.tensor import DTensor, Shard

    efsdp = expert_mesh.size(expert_mesh.ndim - 1)
    local = next(p.to_local() if isinstance(p, DTensor) else p for p in module.parameters()).shape[0]
    placement = Shard(1) if efsdp > local else Shard(0)
    return lambda _param: placement


def _reshard_after_no_grad_forward(model: nn.Module, args, output) -> None:
    """Groups kept gathered after forward (the root, the output group) are normally resharded by
    backward. A no-grad forward (evaluation) has no backward: without this they would stay gathered,
    costing memory, and ``model.parameters()`` would hand out the temporary unsharded tensors (an
    optimizer built from them would silently never update those weights)."""
    if not torch.is_grad_enabled():
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()


def set_gradient_sync(model: nn.Module, enabled: bool, keep_reduce_scatter: bool = False) -> None:
    """Restore (``enabled``) or skip gradient reduction for the next backward passes.

    Skipping drops the replica all-reduce and, unless ``keep_reduce_scatter``, the reduce-scatter
    too (gradients then accumulate unsharded: a full-size gradient per rank)."""
    root = fsdp_root(model)
    if root is None:
        return
    root.set_requires_gradient_sync(enabled or keep_reduce_scatter)
    if not enabled:
        root.set_requires_all_reduce(False)


def fsdp_root(model: nn.Module) -> FSDPModule | None:
    """The outermost FSDP module of ``model`` (``model`` itself, or the Hugging Face model inside a
    wrapper such as a ``PeftModel``); None when nothing is sharded."""
    return next((m for m in model.modules() if isinstance(m, FSDPModule)), None)


@contextlib.contextmanager
def gathered(module: nn.Module):
    """Keep ``module``'s own FSDP parameter group gathered inside the block when a no-grad forward
    has resharded it (``_reshard_after_no_grad_forward``); in a training forward the groups that
    hold the LM head are still gathered (never resharded after forward) and nothing happens."""
    if torch.is_grad_enabled() or not isinstance(module, FSDPModule):
        yield
        return
    module.unshard()
    try:
        yield
    finally:
        module.reshard()
