"""``Accelerator.prepare`` and its per-type steps: parallelise models (and make their
``save_pretrained`` consolidate), wrap optimizers and schedulers so they follow gradient
accumulation, shard data loaders over the data-parallel ranks."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
from torch.utils.data import DataLoader

from ndparallel.accelerator.wrappers import (
    AcceleratedOptimizer,
    AcceleratedScheduler,
    PreparedDataLoader,
)
from ndparallel.checkpoint.save_pretrained import enable_consolidated_save_pretrained
from ndparallel.data.dataloader_sharding import shard_dataloader
from ndparallel.models.adapters import apply_adapter, is_adapter_config
from ndparallel.models.loading import init_non_persistent_buffers, materialize
from ndparallel.models.quantization_config import quantize_for_qlora
from ndparallel.parallel.parallelize import is_meta


def _is_scheduler(obj: Any) -> bool:
    return hasattr(obj, "step") and hasattr(obj, "get_last_lr") and not isinstance(obj, torch.optim.Optimizer)


def prepare_all(acc, objects: list, device_placement) -> list:
    """``device_placement``: None, one bool, or one per object (Accelerate's forms); it only
    decides whether loaders move batches to the device (models always live there)."""

    adapter = next((o for o in objects if is_adapter_config(o)), None)  # e.g. a peft LoraConfig
    out = list(objects)  # the config comes back as given (Accelerate's order-preserving return)
    if not isinstance(device_placement, (list, tuple)):
        device_placement = [device_placement] * len(out)
    if len(device_placement) != len(out):
        raise ValueError(f"device_placement has {len(device_placement)} entries for {len(out)} objects")
    for i, obj in enumerate(out):
        if isinstance(obj, nn.Module):
            out[i] = acc.prepare_model(obj, device_placement=device_placement[i], adapter=adapter)
    for i, obj in enumerate(out):
        if isinstance(obj, torch.optim.Optimizer):
            if adapter is not None:
                raise ValueError(
                    "prepare got an optimizer together with a LoRA config: the optimizer holds "
                    "the base weights LoRA freezes; prepare the model first, then build the "
                    "optimizer from the returned model's parameters"
                )
            out[i] = prepare_optimizer(acc, obj)
    for i, obj in enumerate(out):
        if isinstance(obj, AcceleratedScheduler):
            continue
        if _is_scheduler(obj):
            out[i] = prepare_scheduler(acc, obj)
        elif isinstance(obj, DataLoader):
            out[i] = prepare_data_loader(acc, obj, device_placement[i])
    return out


def _weights_on_rank0_only(acc, model: nn.Module) -> bool:
    """True when rank 0 holds the weights and other ranks an empty (meta) model: what transformers
    loads under Accelerate's ``cpu_ram_efficient_loading`` (``FSDP_CPU_RAM_EFFICIENT_LOADING``)."""
    import torch.distributed as dist

    if acc.num_processes == 1:
        return False
    flags = [torch.zeros(1, dtype=torch.int64) for _ in range(acc.num_processes)]
    dist.all_gather(flags, torch.tensor([int(is_meta(model))]))
    metas = [int(f) for f in flags]
    if not any(metas) or all(metas):
        return False
    if metas[0]:
        raise ValueError(
            "prepare: rank 0's model is on the meta device but other ranks' are not; load the "
            "weights on rank 0 (cpu_ram_efficient_loading) or on every rank"
        )
    return True


def _broadcast_rank0_weights(acc, model: nn.Module, full: dict) -> None:
    """Fill the parallelised model from rank 0's full state dict (each rank keeps its shards)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
    )

    if is_meta(model):
        materialize(model, acc.device)
        init_non_persistent_buffers(model)
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(model, full if acc.is_main_process else {}, options=options)


def prepare_model(acc, model: nn.Module, adapter: Any = None, quantization: Any = None) -> nn.Module:
    """Parallelise ``model`` (``Engine.parallelize``); with weights on rank 0 only
    (``cpu_ram_efficient_loading``) they are broadcast into every rank's shards afterwards.
    ``adapter`` (a peft ``LoraConfig``) wraps the model with LoRA first (a ``PeftModel`` comes
    back); a ``PeftModel`` is parallelised as is. ``quantization`` (QLoRA) stores the frozen base
    linears as NF4 first (``models.quantized``). Optimizers made before are remapped onto the
    parallelised parameters (``prepare_optimizer``)."""
    if any(model is m for m in acc._models):
        return model
    if adapter is not None:
        model = apply_adapter(model, adapter)
    if quantization is not None:
        quantize_for_qlora(model, quantization)
    rank0_only = _weights_on_rank0_only(acc, model)
    full = (
        {k: v.to(acc.device) for k, v in model.state_dict().items()}
        if rank0_only and acc.is_main_process
        else {}
    )
    old: dict[int, list[str]] = {}  # a tied parameter has several names
    for name, p in model.named_parameters(remove_duplicate=False):
        old.setdefault(id(p), []).append(name)
    model = acc.engine.parallelize(model)
    if rank0_only:
        _broadcast_rank0_weights(acc, model, full)
    new = dict(model.named_parameters(remove_duplicate=False))
    kept = {id(p) for p in new.values()}
    staged = acc.engine.dims.pp_enabled  # a pipeline stage holds part of the model:
    for pid, names in old.items():  # the other stages' parameters leave the optimizer
        if pid in kept:
            continue  # parallelised in place: the optimizer's parameter is still the model's
        held = [n for n in names if n in new]
        if held or staged:
            acc._param_remap[pid] = new[held[0]] if held else DROPPED
    return register_model(acc, model)


DROPPED = object()
"""``_param_remap``'s value for a parameter this rank does not hold (another pipeline stage's)."""


def register_model(acc, model: nn.Module) -> nn.Module:
    """Track a parallelised model (``save_state``, ``accumulate``, CP position filling) and make
    its ``save_pretrained`` write one consolidated directory."""

    enable_consolidated_save_pretrained(model)
    acc._models.append(model)
    return model


def prepare_optimizer(acc, optimizer: torch.optim.Optimizer) -> AcceleratedOptimizer:
    """Point the optimizer at the parallelised parameters and wrap it (Accelerate's
    ``AcceleratedOptimizer``: ``step``/``zero_grad`` wait for the step's last micro-batch)."""
    if isinstance(optimizer, AcceleratedOptimizer):
        return optimizer
    if any(optimizer.state.values()):
        raise ValueError(
            "the optimizer already holds state (it has stepped): create it, or call prepare, "
            "before the first optimizer.step()"
        )
    for group in optimizer.param_groups:
        remapped = (acc._param_remap.get(id(p), p) for p in group["params"])
        group["params"] = [p for p in remapped if p is not DROPPED]
    wrapped = AcceleratedOptimizer(optimizer, acc.gradient_state, scaler=acc.scaler)
    acc._optimizers.append(optimizer)
    acc._prepared_optimizers.append(wrapped)
    return wrapped


def prepare_scheduler(acc, scheduler) -> AcceleratedScheduler:
    opt = getattr(scheduler, "optimizer", None)
    optimizers = [
        o for o in acc._prepared_optimizers if o is opt or o.optimizer is opt
    ] or acc._prepared_optimizers
    wrapped = AcceleratedScheduler(
        scheduler,
        optimizers,
        acc.gradient_state,
        steps_per_update=acc.dp_size,
        step_with_optimizer=acc.step_scheduler_with_optimizer,
        split_batches=acc.split_batches,
    )
    acc._schedulers.append(scheduler)
    return wrapped


def prepare_data_loader(acc, loader: DataLoader, device_placement=None) -> PreparedDataLoader:
    """Shard over the dp ranks (tp/cp peers get the same batches); ``split_batches``: the loader's
    batch is the global batch, each dp rank taking ``batch_size / dp`` of it."""

    if isinstance(loader, PreparedDataLoader):
        return loader
    cfg, dp = acc.dataloader_config, acc.dp_size
    per_rank = loader.batch_size
    if cfg.split_batches and per_rank is not None:
        if per_rank % dp:
            raise ValueError(
                f"split_batches=True needs the batch size ({per_rank}) to be a multiple of the "
                f"data-parallel size ({dp})"
            )
        per_rank //= dp
    place = acc.device_placement if device_placement is None else device_placement
    seed = cfg.data_seed if cfg.data_seed is not None else 0
    sharded = shard_dataloader(
        loader,
        acc.dp_rank,
        dp,
        acc.device if place else None,
        batch_size=per_rank,
        seed=seed,
        seeded=cfg.use_seedable_sampler,
    )
    total = None
    if per_rank is not None and hasattr(loader.dataset, "__len__") and not loader.drop_last:
        total = len(loader.dataset)
    prepared = PreparedDataLoader(
        sharded,
        acc.gradient_state,
        acc.rng_types,
        total_samples=total,
        global_batch=per_rank * dp if per_rank else None,
    )
    acc._dataloaders.append(prepared)
    return prepared
