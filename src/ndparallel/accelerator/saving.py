"""Saving and loading, under Accelerate's names: consolidated HF models (``save_model``,
``get_state_dict`` + ``save_pretrained``), sharded training checkpoints (``save_state`` /
``load_state``, DCP: any layout can load them), ``save``, custom checkpointed objects and hooks."""

from __future__ import annotations

import gc
import os
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from ndparallel.accelerator.plugins import ProjectConfiguration
from ndparallel.checkpoint import load_state, save_state
from ndparallel.checkpoint.directory import rotate_checkpoints, validate_checkpoint
from ndparallel.checkpoint.export import save_hf_model
from ndparallel.checkpoint.save_pretrained import full_state_dict


class _Hook:
    def __init__(self, hooks: OrderedDict, key: int):
        self.hooks, self.key = hooks, key

    def remove(self) -> None:
        self.hooks.pop(self.key, None)


class SavingMixin:
    project_configuration: ProjectConfiguration

    # ---------------------------------------------------------- project dirs
    @property
    def project_dir(self):
        return self.project_configuration.project_dir

    @property
    def logging_dir(self):
        return self.project_configuration.logging_dir

    @property
    def save_iteration(self) -> int:
        return self.project_configuration.iteration

    @property
    def should_save_model(self) -> bool:
        """Every rank takes part in saving (the writes themselves happen on rank 0)."""
        return True

    # --------------------------------------------------------------- models
    def unwrap_model(self, model: nn.Module, keep_fp32_wrapper: bool = True, keep_torch_compile: bool = True):
        """The model itself: ``prepare`` parallelises in place (FSDP2 / DTensor) and adds no
        wrapper module, so ``save_pretrained``, ``config`` etc. are reachable directly."""
        if not keep_torch_compile and hasattr(model, "_orig_mod"):
            return model._orig_mod
        return model

    def get_state_dict(self, model: nn.Module, unwrap: bool = True) -> dict:
        """The full (unsharded) state dict as CPU tensors on the main process, ``{}`` on the
        others (Accelerate's FSDP2 behaviour, here for every layout). Collective."""

        return full_state_dict(model)

    def save_model(
        self,
        model: nn.Module,
        save_directory,
        max_shard_size: int | str = "10GB",
        safe_serialization: bool = True,
        tokenizer=None,
        *,
        dtype=None,
    ) -> None:
        """A consolidated Hugging Face directory: weights in ``max_shard_size`` shards (safetensors,
        or ``pytorch_model*.bin`` with ``safe_serialization=False``) + config [+ tokenizer], one
        tensor gathered at a time; ``dtype`` casts floating tensors (default: as trained)."""

        save_hf_model(
            model,
            save_directory,
            is_main=self.is_main_process,
            tokenizer=tokenizer,
            max_shard_size=max_shard_size,
            safe_serialization=safe_serialization,
            dtype=dtype,
        )
        self.wait_for_everyone()

    def save(self, obj: Any, f, safe_serialization: bool = False) -> None:
        """``torch.save`` (or safetensors for a dict of tensors) on the main process only
        (each node's local main with ``ProjectConfiguration(save_on_each_node=True)``)."""
        writer = (
            self.is_local_main_process
            if self.project_configuration.save_on_each_node
            else self.is_main_process
        )
        if not writer:
            return
        if safe_serialization:
            from safetensors.torch import save_file

            save_file(obj, str(f), metadata={"format": "pt"})
        else:
            torch.save(obj, f)

    # -------------------------------------------------------- training state
    def register_for_checkpointing(self, *objects) -> None:
        """Objects with ``state_dict``/``load_state_dict`` saved and restored by ``save_state`` /
        ``load_state`` (their tensors go into the DCP files, the rest into JSON)."""
        bad = [
            i
            for i, o in enumerate(objects)
            if not (hasattr(o, "state_dict") and hasattr(o, "load_state_dict"))
        ]
        if bad:
            raise ValueError(
                "All `objects` must include a `state_dict` and `load_state_dict` function to be "
                f"stored. Invalid: items at index {bad}"
            )
        self._custom_objects.extend(objects)

    def register_save_state_pre_hook(self, hook: Callable) -> _Hook:
        """``hook(models, weights, output_dir)`` runs before ``save_state``; a model it removes from
        ``models`` is not saved."""
        key = id(hook)
        self._save_model_state_pre_hook[key] = hook
        return _Hook(self._save_model_state_pre_hook, key)

    def register_load_state_pre_hook(self, hook: Callable) -> _Hook:
        """``hook(models, input_dir)`` runs before ``load_state``; a model it removes is not loaded."""
        key = id(hook)
        self._load_model_state_pre_hook[key] = hook
        return _Hook(self._load_model_state_pre_hook, key)

    def save_state(
        self, output_dir: str | None = None, safe_serialization: bool = True, **save_model_func_kwargs
    ):
        """Sharded checkpoint (DCP) of the prepared models, optimizers, schedulers, registered
        objects and RNG states; complete only once every rank has written; loadable on any layout.
        Nothing in it is unpickled on load, so ``safe_serialization`` holds either way. Without
        ``output_dir``: ``project_dir/checkpoints/checkpoint_{iteration}`` (automatic naming)."""

        if save_model_func_kwargs:
            raise ValueError(
                f"save_state({', '.join(save_model_func_kwargs)}=...) are options of Accelerate's "
                "per-model weight files; DCP checkpoints take none (use save_model for HF files)"
            )
        output_dir = self._checkpoint_dir_for_save(output_dir)
        models = list(self._models)
        for hook in self._save_model_state_pre_hook.values():
            hook(models, [m.state_dict() for m in models], str(output_dir))
        extra = {"custom_objects": [o.state_dict() for o in self._custom_objects]}
        if self.scaler is not None:  # fp16: resume with the same loss scale
            extra["loss_scale"] = self.scaler.state_dict()
        out = save_state(
            output_dir,
            models,
            self._optimizers_of(models),
            self._schedulers,
            extra=extra,
            layout=self.engine.dims,
        )
        self._rotate_automatic_checkpoints()  # only now that the new one is complete
        self.project_configuration.iteration += 1
        return str(out)

    def _rotate_automatic_checkpoints(self) -> None:
        """``ProjectConfiguration(total_limit=N)``: keep the newest N complete ``checkpoint_*``
        folders. Runs after the new checkpoint is complete, so a failed save (crash, full disk)
        never costs the previous one (``checkpoint.directory.rotate_checkpoints``)."""
        project = self.project_configuration
        if project.automatic_checkpoint_naming and project.total_limit is not None and self.is_main_process:
            rotate_checkpoints(
                Path(project.project_dir or ".") / "checkpoints", project.total_limit, prefix="checkpoint_"
            )
        self.wait_for_everyone()

    def load_state(
        self, input_dir: str | None = None, load_kwargs: dict | None = None, **load_model_func_kwargs
    ):
        """Load a ``save_state`` checkpoint into the prepared objects, resharding to this layout."""

        if load_kwargs or load_model_func_kwargs:
            raise ValueError(
                "load_state(load_kwargs / model kwargs) are options of Accelerate's torch.load "
                "of weight files; DCP checkpoints are read without them"
            )
        input_dir = self._checkpoint_dir_for_load(input_dir)
        models = list(self._models)
        for hook in self._load_model_state_pre_hook.values():
            hook(models, str(input_dir))
        out = load_state(input_dir, models, self._optimizers_of(models), self._schedulers)
        saved = out.get("custom_objects") or []
        if len(saved) != len(self._custom_objects):
            raise ValueError(
                f"checkpoint {input_dir} holds {len(saved)} registered objects, "
                f"{len(self._custom_objects)} are registered now"
            )
        for obj, state in zip(self._custom_objects, saved):
            obj.load_state_dict(state)
        if self.scaler is not None and out.get("loss_scale"):
            self.scaler.load_state_dict(out["loss_scale"])
        return out

    def _optimizers_of(self, models: list[nn.Module]) -> list:
        ids = {id(p) for m in models for p in m.parameters()}
        return [o for o in self._optimizers if any(id(p) in ids for g in o.param_groups for p in g["params"])]

    def _checkpoint_dir_for_save(self, output_dir) -> Path:
        project = self.project_configuration
        if not project.automatic_checkpoint_naming:
            if output_dir is None:
                raise ValueError(
                    "save_state() needs output_dir, or ProjectConfiguration(project_dir=..., "
                    "automatic_checkpoint_naming=True)"
                )
            return Path(os.path.expanduser(str(output_dir)))
        root = Path(project.project_dir or ".") / "checkpoints"
        if self.is_main_process:
            root.mkdir(parents=True, exist_ok=True)
        target = root / f"checkpoint_{project.iteration}"
        if target.exists() and not validate_checkpoint(target, deep=False):  # a failed save may be retried
            raise ValueError(
                f"Checkpoint directory {target} already exists: set "
                "accelerator.project_configuration.iteration to the next free number"
            )
        self.wait_for_everyone()
        return target

    def _checkpoint_dir_for_load(self, input_dir) -> Path:
        project = self.project_configuration
        if input_dir is None:
            if not project.automatic_checkpoint_naming:
                raise ValueError("load_state() needs input_dir (or automatic_checkpoint_naming=True)")
            root = Path(project.project_dir or ".") / "checkpoints"
            folders = sorted((p for p in root.glob("checkpoint_*")), key=lambda p: int(p.name.split("_")[-1]))
            if not folders:
                raise ValueError(f"no checkpoint_* folder in {root}")
            project.iteration = int(folders[-1].name.split("_")[-1]) + 1
            return folders[-1]
        path = Path(os.path.expanduser(str(input_dir)))
        if not path.is_dir():
            raise ValueError(f"Tried to find {path} but folder does not exist")
        return path

    # ------------------------------------------------------------- memory
    def free_memory(self, *objects):
        """Drop the Accelerator's references to prepared objects, reset ``step``, collect garbage;
        returns ``objects`` set to None (assign them back to release yours)."""
        self._models, self._optimizers, self._prepared_optimizers = [], [], []
        self._schedulers, self._dataloaders = [], []
        self._param_remap.clear()
        self.step = 0
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return [None] * len(objects)

    def clear(self, *objects):
        """Alias of ``free_memory``."""
        return self.free_memory(*objects)
