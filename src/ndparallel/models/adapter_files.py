"""A saved PEFT LoRA adapter directory (``adapter_config.json`` + ``adapter_model.safetensors``, as
PEFT's ``save_pretrained`` and ``ndparallel export`` write it) as the starting point of a run:
Axolotl's ``lora_model_dir``. Its config decides r, alpha and the adapted modules; its tensors
replace the fresh init. Header-only checks run before any rank starts; the tensors (r × d each,
small) are read in full by every rank and each keeps its shard.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from ndparallel.models.adapters import (
    check_adapter_config,
    peft_save_key,
    require_peft,
    trained_shapes,
)

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def read_adapter_config(directory: str | os.PathLike, dropout: float | None = None):
    """The ``LoraConfig`` saved in ``directory``, made trainable (``inference_mode`` off);
    ``dropout`` replaces its ``lora_dropout`` (a training-time setting) when given. Raises
    ``ValueError`` naming the file and the fix."""
    peft = require_peft()
    path = Path(directory)
    if not path.is_dir():
        raise ValueError(
            f"{path} is not a directory: give the folder PEFT's save_pretrained "
            "(or `ndparallel export` of a LoRA run) wrote"
        )
    for name, what in ((ADAPTER_CONFIG, "the adapter's config"), (ADAPTER_WEIGHTS, "its weights")):
        if not (path / name).is_file():
            hint = (
                " (adapter_model.bin is not read: re-save it with safe_serialization=True)"
                if name == ADAPTER_WEIGHTS and (path / "adapter_model.bin").is_file()
                else ""
            )
            raise ValueError(f"{path} has no {name} ({what}){hint}")
    try:
        config = peft.PeftConfig.from_pretrained(str(path))
    except Exception as e:  # noqa: BLE001 - a broken or foreign JSON file
        raise ValueError(f"{path / ADAPTER_CONFIG} cannot be read by peft: {e}") from None
    try:
        check_adapter_config(config)
    except ValueError as e:
        raise ValueError(f"{path / ADAPTER_CONFIG}: {e}") from None
    init = getattr(config, "init_lora_weights", True)
    if init not in (True, False, "gaussian"):
        raise ValueError(
            f"{path / ADAPTER_CONFIG}: init_lora_weights={init!r} changes the base weights "
            "(PiSSA/OLoRA/LoftQ-style); only adapters over the unchanged base are supported "
            "(convert it with PEFT's path_initial_model_for_weight_conversion first)"
        )
    config.init_lora_weights = True  # the cheap default: the saved tensors replace it
    config.inference_mode = False
    if dropout is not None:
        config.lora_dropout = dropout
    return config


def _expected(model: nn.Module) -> dict[str, tuple[str, torch.Size]]:
    """For every adapter parameter (and trained ``modules_to_save`` copy) of a PEFT model: the key
    PEFT saves it under -> (our name, shape). The shape is the full (unsharded) one: DTensor
    parameters report it too. Tied copies count under each name (PEFT saves both). A pipeline stage
    view expects the whole model's (``trained_shapes``)."""
    return {peft_save_key(n): (n, torch.Size(shape)) for n, shape, _ in trained_shapes(model)}


def adapter_weights_problem(model: nn.Module, directory: str | os.PathLike) -> str | None:
    """Whether the saved tensors fit ``model`` (a PEFT model wrapped with the saved config): the
    same keys and shapes, read from the safetensors header only. None when they do."""
    from safetensors import safe_open

    file = Path(directory) / ADAPTER_WEIGHTS
    expected = _expected(model)
    try:
        with safe_open(str(file), framework="pt") as f:
            shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    except Exception as e:  # noqa: BLE001 - a truncated or foreign file
        return f"{file} is not a readable safetensors file ({e})"
    missing = sorted(set(expected) - set(shapes))
    extra = sorted(set(shapes) - set(expected))
    if missing or extra:
        parts = ([f"{len(missing)} tensor(s) missing, e.g. {missing[0]}"] if missing else []) + (
            [f"{len(extra)} unexpected, e.g. {extra[0]}"] if extra else []
        )
        return (
            f"{file} does not match the model: {'; '.join(parts)} (an adapter of another "
            "model, or one with embedding adapters / trainable tokens, which are not supported)"
        )
    for key, (_, shape) in expected.items():
        if tuple(shape) != shapes[key]:
            return (
                f"{file}: {key} has shape {list(shapes[key])}, the model needs {list(shape)} "
                "(an adapter trained on another model size)"
            )
    return None


def read_adapter_weights(model: nn.Module, directory: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The saved adapter tensors under ``model``'s own parameter names, in its parameters' dtype
    (full tensors; each rank keeps its shard when they are set; a pipeline stage view: its own)."""
    from safetensors.torch import load_file

    problem = adapter_weights_problem(model, directory)
    if problem:
        raise ValueError(problem)
    saved = load_file(str(Path(directory) / ADAPTER_WEIGHTS))
    dtypes: dict[str, Any] = {n: p.dtype for n, p in model.named_parameters(remove_duplicate=False)}
    return {
        name: saved[key].to(dtypes[name]) for key, (name, _) in _expected(model).items() if name in dtypes
    }
