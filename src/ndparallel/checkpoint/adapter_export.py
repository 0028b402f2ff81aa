"""LoRA adapters written in PEFT's own format: ``adapter_config.json`` + ``adapter_model.safetensors``,
which ``PeftModel.from_pretrained(base_model, directory)`` loads.

* ``save_adapter``: from a parallelised ``PeftModel`` (any layout). Only the trained tensors are
  gathered (``full_tensor``, one at a time: r·(in + out) per adapted linear, and each
  ``modules_to_save`` module whole, e.g. vocab × hidden for ``embed_tokens``); rank 0 names them
  with PEFT's ``get_peft_model_state_dict`` and writes the directory. Under pipeline parallel each
  stage gathers its own and sends them to rank 0, which names them as ``export_adapter_checkpoint``
  does (``peft_save_key``: PEFT's function needs every stage's modules).
* ``export_adapter_checkpoint``: from a DCP checkpoint of a LoRA run, on one process without peft
  (the checkpoint holds only trained tensors; the adapter config was saved beside it).

The merged model (``W + scaling · B @ A`` in a plain Hugging Face directory) is written by
``ndparallel.checkpoint.export.save_hf_model(..., merge_adapter=True)``.
"""

from __future__ import annotations

import copy
import os
import shutil
import warnings
from pathlib import Path

import torch
import torch.nn as nn

from ndparallel.checkpoint.directory import HF_CONFIG_DIR, validate_checkpoint
from ndparallel.checkpoint.hf_files import save_tokenizer
from ndparallel.checkpoint.io import SafeFileSystemReader, read_dcp_metadata
from ndparallel.checkpoint.stage_export import is_pipeline_view, stage_tensors
from ndparallel.models.adapter_files import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from ndparallel.models.adapters import (
    ADAPTER_NAME,
    adapter_config_of,
    is_trained_state,
    peft_save_key,
)


def save_adapter(model: nn.Module, directory: str | os.PathLike, is_main: bool, tokenizer=None) -> None:
    """Write the PEFT adapter directory of ``model`` (a parallelised ``PeftModel``, or a pipeline
    stage view of one: every stage's tensors streamed to the first stage). Collective: every rank
    calls it; only ``is_main`` writes."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
    )

    state = get_model_state_dict(model, options=StateDictOptions(ignore_frozen_params=True))
    gather = _stage_tensors if is_pipeline_view(model) else _peft_tensors
    tensors = gather(model, state, is_main)
    if is_main:
        _write_adapter(model, tensors, Path(directory), tokenizer)


def _full(value: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return value.full_tensor() if isinstance(value, DTensor) else value  # tiny: r × d


def _peft_tensors(model: nn.Module, state: dict, is_main: bool) -> dict[str, torch.Tensor] | None:
    """The trained tensors gathered, named on rank 0 by PEFT (``get_peft_model_state_dict``)."""
    full = {}
    for name, value in state.items():
        t = _full(value)
        if is_main:
            full[name] = t.detach().to("cpu").contiguous()
    if not is_main:
        return None
    from peft import get_peft_model_state_dict

    return get_peft_model_state_dict(model, state_dict=full, adapter_name=ADAPTER_NAME)


def _stage_tensors(model: nn.Module, state: dict, is_main: bool) -> dict[str, torch.Tensor] | None:
    """Every pipeline stage's trained tensors on rank 0, named as PEFT saves them (``peft_save_key``:
    PEFT's own function needs every stage's modules, and rank 0 holds its own stages only)."""
    names = [n for n in state if is_trained_state(n)]
    stream = stage_tensors(model, state, names, lambda name: _full(state[name]), None)  # collective
    tensors = {peft_save_key(name): t.detach().to("cpu").contiguous() for name, t in stream if is_main}
    return tensors if is_main else None


def _write_adapter(model: nn.Module, tensors: dict[str, torch.Tensor], out: Path, tokenizer) -> None:
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    save_file(
        {k: v.contiguous() for k, v in tensors.items()}, str(out / ADAPTER_WEIGHTS), metadata={"format": "pt"}
    )
    config = copy.deepcopy(adapter_config_of(model))
    config.inference_mode = True
    config.save_pretrained(str(out))
    save_tokenizer(tokenizer, out)


def is_adapter_checkpoint(checkpoint_dir: str | os.PathLike) -> bool:
    """A checkpoint of a LoRA run (``save_state`` stored the adapter config beside the HF config)."""
    return (Path(checkpoint_dir) / HF_CONFIG_DIR / ADAPTER_CONFIG).is_file()


def export_adapter_checkpoint(
    checkpoint_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    tokenizer=None,
    dtype: torch.dtype | None = None,
) -> Path:
    """The PEFT adapter directory of a LoRA checkpoint (any layout), on one process, no peft needed.
    ``dtype`` casts the adapter tensors (default: as trained, fp32)."""
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file

    ckpt, out = Path(checkpoint_dir), Path(out_dir)
    problems = validate_checkpoint(ckpt)
    if problems:
        raise ValueError(f"cannot export {ckpt}: " + "; ".join(problems))
    metadata = read_dcp_metadata(ckpt).state_dict_metadata
    names = [k for k in metadata if k.startswith("model/") and is_trained_state(k)]
    if not names:
        raise ValueError(f"checkpoint {ckpt} holds no LoRA adapter tensors")
    targets = {k: torch.empty(metadata[k].size, dtype=metadata[k].properties.dtype) for k in names}
    with warnings.catch_warnings():  # "assuming ... a single process": yes, on purpose
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(targets, storage_reader=SafeFileSystemReader(ckpt), no_dist=True)
    tensors = {
        peft_save_key(k.removeprefix("model/")): (t.to(dtype) if dtype is not None else t)
        for k, t in targets.items()
    }
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    shutil.copyfile(ckpt / HF_CONFIG_DIR / ADAPTER_CONFIG, out / ADAPTER_CONFIG)
    save_tokenizer(tokenizer, out)
    return out
