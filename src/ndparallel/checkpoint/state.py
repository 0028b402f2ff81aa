"""Sharded training checkpoints: save on any layout, resume on any other, never half-written.

A checkpoint directory (``output_dir/checkpoint-{step}/``) holds:

* DCP files (``__<rank>_0.distcp`` + ``.metadata``): every tensor — model and optimizer state from
  ``get_model_state_dict`` / ``get_optimizer_state_dict`` (sharded DTensors, canonical FQNs, so a
  later load on another mesh or world size reshards them), and any tensor inside the scheduler,
  loader or ``extra`` states;
* ``state.json`` (rank 0): the JSON skeletons of those states (param groups, scheduler, data-loader
  position, step, resolved config, ``extra``) with the tensors named by their DCP key;
* ``rng/rank-XXXXX.json``: each rank's python / numpy / torch / CUDA RNG states;
* ``hf/config.json``: the model's HF config, so ``ndparallel export`` needs nothing else;
* ``COMPLETE``: written last, by rank 0, after a barrier that every rank reaches only once its own
  files are written — tmp file + ``os.replace``, listing every file with its size (and a sha256
  of the small ones). A directory without a valid marker is never taken for a checkpoint.

Nothing is unpickled on load: JSON, DCP tensor data via ``torch.load(weights_only=True)``, and
DCP's ``.metadata`` through an allow-list unpickler (``checkpoint.io``). All ranks must see the
same filesystem (multi-node: a shared one).
"""

from __future__ import annotations

import copy
import dataclasses
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import StateDictOptions

from ndparallel.checkpoint.directory import (
    FORMAT,
    HF_CONFIG_DIR,
    STATE_FILE,
    check_target_dir,
    checkpoint_dir,
    prepare_dir,
    rotate_checkpoints,
    validate_checkpoint,
    write_marker,
)
from ndparallel.checkpoint.io import (
    SafeFileSystemReader,
    join_tensors,
    read_dcp_metadata,
    read_json,
    rng_state,
    set_rng_state,
    split_tensors,
    tensor_keys,
    write_json_atomic,
)
from ndparallel.checkpoint.stage_export import is_pipeline_view
from ndparallel.checkpoint.stage_state import merge_stage_skeletons, restrict_to_stage
from ndparallel.models.adapters import adapter_config_of, base_model_of, is_peft_model
from ndparallel.models.naming import model_class_name
from ndparallel.runtime.distributed import rank0_decides


# ------------------------------------------------------------------------------ save / load
def save_checkpoint(
    directory: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    scheduler=None,
    extra: dict | None = None,
    *,
    loader=None,
    step: int | None = None,
    config: Any = None,
    layout=None,
) -> Path:
    """Save ``model``, ``optimizer``, ``scheduler``, ``loader`` position, RNG states, ``step``,
    ``config`` and ``extra`` (JSON-able; tensors allowed) into ``directory``. Call on every rank.
    ``layout`` (a ``ParallelDims``, recorded for information): the layout that saved it."""
    return save_state(
        directory,
        [model],
        [optimizer] if optimizer is not None else [],
        [scheduler] if scheduler is not None else [],
        extra=extra,
        loaders=[loader] if loader is not None else [],
        step=step,
        config=config,
        layout=layout,
    )


def load_checkpoint(
    directory: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    scheduler=None,
    *,
    loader=None,
    restore_rng: bool = True,
) -> dict:
    """Load what ``save_checkpoint`` wrote into the (already parallelised) objects, on any layout.
    Returns the saved ``extra`` plus ``step``, ``config`` and ``loader`` (its state) when absent."""
    return load_state(
        directory,
        [model],
        [optimizer] if optimizer is not None else [],
        [scheduler] if scheduler is not None else [],
        loaders=[loader] if loader is not None else [],
        restore_rng=restore_rng,
    )


def save_state(
    directory: str | os.PathLike,
    models: Sequence[nn.Module] = (),
    optimizers: Sequence[torch.optim.Optimizer] = (),
    schedulers: Sequence[Any] = (),
    extra: dict | None = None,
    *,
    loaders: Sequence[Any] = (),
    step: int | None = None,
    config: Any = None,
    layout=None,
) -> Path:
    """Several models / optimizers / schedulers / loaders into one checkpoint (what
    ``Accelerator.save_state`` saves). Every rank must call it; returns the directory."""
    directory = Path(directory)
    tensors, state = collect_state(models, optimizers, schedulers, extra, loaders, step, config, layout)
    start_save(directory, state, models)
    dcp.save(tensors, storage_writer=dcp.FileSystemWriter(directory, single_file_per_rank=True))
    _barrier()  # every rank's files are on disk
    if _rank() == 0:
        write_marker(directory, state)
    _barrier()  # nobody moves on (to rotate, or to read) before the marker exists
    return directory


def collect_state(models, optimizers, schedulers, extra, loaders, step, config, layout):
    """``(tensors, state)``: every tensor to save by DCP key (this rank's shards, sharing storage
    with the live objects) and the JSON skeleton ``state.json`` holds."""
    models, optimizers, schedulers = _uniq(models), _uniq(optimizers), _uniq(schedulers)
    extra = dict(extra or {})
    if step is None and isinstance(extra.get("step"), int):
        step = extra["step"]
    tensors: dict[str, torch.Tensor] = {}
    state: dict[str, Any] = {
        "format": FORMAT,
        "step": step,
        "world_size": _world(),
        "layout": layout.to_dict() if layout is not None else None,
    }
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    state["models"] = [
        split_tensors(_trained_state(m), _key("model", i), tensors) for i, m in enumerate(models)
    ]
    state["optimizers"] = [
        split_tensors(get_optimizer_state_dict(_owner(models, o), o), _key("optimizer", i), tensors)
        for i, o in enumerate(optimizers)
    ]
    merge_stage_skeletons(models, state)  # pipeline parallel: state.json lists every stage's tensors
    state["schedulers"] = [
        split_tensors(s.state_dict(), _key("scheduler", i), tensors) for i, s in enumerate(schedulers)
    ]
    state["loaders"] = [
        split_tensors(ld.state_dict(), _key("loader", i), tensors) for i, ld in enumerate(loaders)
    ]
    state["config"] = split_tensors(_jsonable_config(config), "config", tensors)
    state["extra"] = split_tensors(extra, "extra", tensors)
    return tensors, state


def start_save(directory: Path, state: dict, models: Sequence[nn.Module]) -> None:
    """Everything of a save but the DCP tensor files and the marker: the target checked on every
    rank, then (re)created by rank 0, then this rank's RNG states and rank 0's ``state.json`` and HF
    config. Collective (barrier after the directory exists)."""
    models = _uniq(models)
    rank = _rank()
    check_target_dir(directory)  # on every rank (same filesystem), so all raise together
    _barrier()  # every rank has looked before rank 0 empties it (a peer listing it mid-rmtree failed)
    if rank == 0:
        prepare_dir(directory)
    _barrier()
    (directory / "rng").mkdir(exist_ok=True)
    write_json_atomic(directory / "rng" / f"rank-{rank:05d}.json", rng_state())
    if rank == 0:
        write_json_atomic(directory / STATE_FILE, state)
        _save_hf_config(models[0] if models else None, directory / HF_CONFIG_DIR)
        if models and is_peft_model(models[0]):  # what `ndparallel export` writes with the adapter
            adapter_config_of(models[0]).save_pretrained(str(directory / HF_CONFIG_DIR))


def load_state(
    directory: str | os.PathLike,
    models: Sequence[nn.Module] = (),
    optimizers: Sequence[torch.optim.Optimizer] = (),
    schedulers: Sequence[Any] = (),
    *,
    loaders: Sequence[Any] = (),
    restore_rng: bool = True,
) -> dict:
    """Restore what ``save_state`` wrote, resharding DTensors to this run's layout. Raises
    ``ValueError`` for an incomplete or corrupted directory."""
    from torch.distributed.checkpoint.state_dict import (
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    models, optimizers, schedulers = _uniq(models), _uniq(optimizers), _uniq(schedulers)
    directory = Path(directory)
    problems = rank0_decides(validate_checkpoint, directory)  # hashed once, not once per rank
    if problems:
        raise ValueError(f"cannot load checkpoint {directory}: " + "; ".join(problems))
    state = read_json(directory / STATE_FILE)
    for what, have, saved in (
        ("models", models, state["models"]),
        ("optimizers", optimizers, state["optimizers"]),
        ("schedulers", schedulers, state["schedulers"]),
    ):
        if len(have) != len(saved):
            raise ValueError(f"checkpoint {directory} holds {len(saved)} {what}, but {len(have)} were given")

    # Targets: this run's (sharded) state dicts; DCP reads each rank's part of each tensor into them.
    current: dict[str, torch.Tensor] = {}
    staged = any(is_pipeline_view(m) for m in models)  # a stage loads its own names only
    for i, m in enumerate(models):
        mine = split_tensors(_trained_state(m), _key("model", i), current)
        frozen = _frozen_names(m)  # (older checkpoints hold a LoRA base's tied, frozen LM head)
        state["models"][i] = {k: v for k, v in state["models"][i].items() if k not in frozen}
        if staged:
            state["models"][i] = restrict_to_stage(state["models"][i], mine, optimizer=False)
        _check_same_params(directory, set(state["models"][i]), mine)
    for i, o in enumerate(optimizers):
        mine = split_tensors(get_optimizer_state_dict(_owner(models, o), o), _key("optimizer", i), current)
        if staged:
            state["optimizers"][i] = restrict_to_stage(state["optimizers"][i], mine, optimizer=True)
    wanted = tensor_keys(
        [state[k] for k in ("models", "optimizers", "schedulers", "loaders", "config", "extra")]
    )
    metadata = read_dcp_metadata(directory).state_dict_metadata
    targets: dict[str, torch.Tensor] = {}
    for key in wanted:
        if key in current:
            targets[key] = current[key]
        elif key in metadata:
            md = metadata[key]
            targets[key] = torch.empty(md.size, dtype=md.properties.dtype)
        else:
            raise ValueError(f"checkpoint {directory} is missing tensor {key!r}")
    dcp.load(targets, storage_reader=SafeFileSystemReader(directory))

    for i, m in enumerate(models):  # frozen parameters are not in the checkpoint (checked above)
        set_model_state_dict(
            m, join_tensors(state["models"][i], targets), options=StateDictOptions(strict=False)
        )
    for i, o in enumerate(optimizers):
        set_optimizer_state_dict(_owner(models, o), o, join_tensors(state["optimizers"][i], targets))
    for i, s in enumerate(schedulers):
        s.load_state_dict(join_tensors(state["schedulers"][i], targets))
    loader_states = [join_tensors(s, targets) for s in state["loaders"]]
    for ld, ls in zip(loaders, loader_states):
        ld.load_state_dict(ls)
    if restore_rng:
        _restore_rng(directory, state)
    out = dict(join_tensors(state["extra"], targets))
    out.setdefault("step", state.get("step"))
    out.setdefault("config", join_tensors(state["config"], targets))
    out.setdefault("loader", loader_states[0] if loader_states else None)
    _barrier()
    return out


def save_step_checkpoint(
    output_dir: str | os.PathLike,
    step: int,
    model: nn.Module,
    optimizer,
    scheduler=None,
    *,
    loader=None,
    config: Any = None,
    extra: dict | None = None,
    save_total_limit: int | None = None,
    layout=None,
) -> Path:
    """Save ``output_dir/checkpoint-{step}`` and then, if ``save_total_limit`` is set, delete all
    but the newest ``save_total_limit`` complete checkpoints (only once the new one is complete)."""
    path = save_checkpoint(
        checkpoint_dir(output_dir, step),
        model,
        optimizer,
        scheduler,
        extra,
        loader=loader,
        step=step,
        config=config,
        layout=layout,
    )
    if save_total_limit is not None and _rank() == 0:
        rotate_checkpoints(output_dir, save_total_limit, background=True)  # renames, then returns
    _barrier()
    return path


# ----------------------------------------------------------------------------- internals
_TRAINED = StateDictOptions(ignore_frozen_params=True)
"""Model state saved: trainable parameters and buffers. Frozen parameters (a LoRA base model) are
left out: they never change, and come back from the base model when a run resumes."""


_WRAPPER_PARTS = ("_checkpoint_wrapped_module", "_orig_mod", "_fsdp_wrapped_module")


def _frozen_names(model: nn.Module) -> set[str]:
    """Every name of every frozen parameter, as DCP names it (wrapper parts dropped)."""
    return {
        ".".join(p for p in name.split(".") if p not in _WRAPPER_PARTS)
        for name, param in model.named_parameters(remove_duplicate=False)
        if not param.requires_grad
    }


def _trained_state(model: nn.Module) -> dict:
    """The model state a checkpoint holds (``_TRAINED``). DCP leaves a frozen parameter out under its
    first name only: a LoRA base's tied LM head (vocab × hidden) came along under ``lm_head.weight``,
    which a pipeline stage holding the head alone does not have. Every frozen name is left out."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    frozen = _frozen_names(model)
    return {k: v for k, v in get_model_state_dict(model, options=_TRAINED).items() if k not in frozen}


def _check_same_params(directory: Path, saved: set[str], current: dict) -> None:
    """The checkpoint holds exactly this model's trained tensors (e.g. not a LoRA adapter's for a
    full model, or the reverse); names the first differences."""
    if saved == set(current):
        return
    missing, unexpected = sorted(set(current) - saved), sorted(saved - set(current))
    raise ValueError(
        f"checkpoint {directory} does not fit this model: {len(missing)} trained tensor(s) missing "
        f"(e.g. {missing[:2]}), {len(unexpected)} unexpected (e.g. {unexpected[:2]}); was it "
        "saved with another adapter setting (adapter: lora or not, other lora_target_modules)?"
    )


def _key(kind: str, i: int) -> str:
    return kind if i == 0 else f"{kind}_{i}"


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def _uniq(xs) -> list:
    """``xs`` without repeats (by identity), in order."""
    seen, out = set(), []
    for x in xs or ():
        if id(x) not in seen:
            seen.add(id(x))
            out.append(x)
    return out


def _owner(models: Sequence[nn.Module], optimizer) -> nn.Module:
    """The model whose parameters ``optimizer`` updates."""
    ids = {id(p) for g in optimizer.param_groups for p in g["params"]}
    for m in models:
        if any(id(p) in ids for p in m.parameters()):
            return m
    raise ValueError("an optimizer updates parameters of none of the models given; pass its model")


def _jsonable_config(config: Any) -> Any:
    if config is None or isinstance(config, (dict, list, str, int, float, bool)):
        return copy.deepcopy(config)
    if hasattr(config, "model_dump"):  # pydantic
        return config.model_dump(mode="json")
    if dataclasses.is_dataclass(config):
        return dataclasses.asdict(config)
    if hasattr(config, "to_dict"):
        return config.to_dict()
    raise TypeError(f"cannot store a config of type {type(config).__name__}: pass a dict")


def _save_hf_config(model: nn.Module | None, target: Path) -> None:
    model = base_model_of(model) if model is not None else None
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "save_pretrained"):
        return
    config = copy.deepcopy(config)
    config.architectures = [model_class_name(model)]
    config.save_pretrained(target)
    gen = getattr(model, "generation_config", None)
    if gen is not None and hasattr(gen, "save_pretrained"):
        try:
            gen.save_pretrained(target)
        except Exception:  # noqa: BLE001 - an invalid generation config is not worth a failed save
            pass


def _restore_rng(directory: Path, state: dict) -> None:
    rank = _rank()
    f = directory / "rng" / f"rank-{rank:05d}.json"
    if not f.is_file():  # a larger world than the one that saved: take rank 0's states
        f = directory / "rng" / "rank-00000.json"
    set_rng_state(read_json(f))
