"""Consolidated Hugging Face export (safetensors), streamed one tensor at a time.

* ``save_hf_model`` (``Accelerator.save_model``, end of training): every rank walks the model's
  sharded state dict in the same order and ``full_tensor()``s one parameter at a time (an
  all-gather); rank 0 appends it to the current safetensors shard and writes the shard once it
  reaches ``max_shard_size``. Beyond its own shard a rank holds one full tensor; rank 0 at most
  ``max_shard_size`` + one tensor. Tied weights are written once (under the name HF keeps).
* ``export_checkpoint`` (``ndparallel export CKPT OUT``): one process, no GPU, no process group:
  reads the model tensors of a DCP checkpoint shard-group by shard-group straight into full
  tensors and writes the same HF layout, with the config saved in the checkpoint.

Layout written: ``config.json`` (+ ``generation_config.json``), ``model.safetensors`` or
``model-0000i-of-0000n.safetensors`` + ``model.safetensors.index.json``, tokenizer files if given.
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from ndparallel.checkpoint.adapter_export import (
    export_adapter_checkpoint,
    is_adapter_checkpoint,
    save_adapter,
)
from ndparallel.checkpoint.directory import HF_CONFIG_DIR, validate_checkpoint
from ndparallel.checkpoint.hf_files import (
    copy_generation_config,
    save_tokenizer,
    write_hf_config,
)
from ndparallel.checkpoint.io import SafeFileSystemReader, read_dcp_metadata
from ndparallel.checkpoint.stage_export import (
    is_pipeline_view,
    pipeline_tied_copies,
    stage_names,
    stage_tensors,
)
from ndparallel.models.adapters import (
    base_model_of,
    checkpoint_key,
    is_adapter_param,
    is_frozen_original,
    is_peft_model,
    merge_specs,
    merged_weight,
)
from ndparallel.models.key_conversion import SaveConversion
from ndparallel.models.naming import model_class_name, tied_aliases
from ndparallel.models.presets import is_preset, preset_config
from ndparallel.models.quantized import dequantize, is_nf4
from ndparallel.runtime.sizes import parse_size

DEFAULT_MAX_SHARD_SIZE = 5 * 1000**3
DTYPES = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
}


class ShardWriter:
    """Collects tensors into safetensors files of at most ``max_shard_size`` bytes (a tensor larger
    than that gets a file of its own) and writes HF's index when there is more than one.
    ``safe=False`` writes ``pytorch_model*.bin`` files (torch.save) under HF's names instead."""

    def __init__(
        self,
        directory: str | os.PathLike,
        max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
        safe: bool = True,
        conversion: SaveConversion | None = None,
    ):
        self.conversion = conversion  # model keys -> the checkpoint layout transformers writes
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.safe = safe
        self.stem, self.ext = ("model", "safetensors") if safe else ("pytorch_model", "bin")
        for pattern in ("model*.safetensors*", "pytorch_model*.bin*"):  # a previous export's shards
            for old in self.dir.glob(pattern):
                old.unlink()
        self.max = int(parse_size(max_shard_size))
        self.current: dict[str, torch.Tensor] = {}
        self.current_bytes = 0
        self.files: list[tuple[str, list[str]]] = []
        self.total = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        """Add a model tensor (converted to the checkpoint's keys with ``conversion``)."""
        if self.conversion is None:
            return self._add(name, tensor)
        for key, t in self.conversion.add(name, tensor).items():
            self._add(key, t)

    def _add(self, name: str, tensor: torch.Tensor) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        if self.current and self.current_bytes + nbytes > self.max:
            self.flush()
        self.current[name] = tensor.detach().contiguous()
        self.current_bytes += nbytes
        self.total += nbytes

    def flush(self) -> None:
        from safetensors.torch import save_file

        if not self.current:
            return
        tmp = f".shard-{len(self.files):05d}.{self.ext}.tmp"
        if self.safe:
            save_file(self.current, str(self.dir / tmp), metadata={"format": "pt"})
        else:
            torch.save(self.current, self.dir / tmp)
        self.files.append((tmp, list(self.current)))
        self.current, self.current_bytes = {}, 0

    def finish(self) -> list[str]:
        """Write the last shard, give the files their final names; returns them."""
        if self.conversion is not None and self.conversion.pending():
            raise RuntimeError(
                f"export: tensors {self.conversion.pending()[:3]} were never written: their "
                "conversion group (transformers' checkpoint layout) is incomplete"
            )
        self.flush()
        n = len(self.files)
        stem, ext = self.stem, self.ext
        names = [f"{stem}.{ext}"] if n == 1 else [f"{stem}-{i + 1:05d}-of-{n:05d}.{ext}" for i in range(n)]
        weight_map = {}
        for (tmp, keys), name in zip(self.files, names):
            os.replace(self.dir / tmp, self.dir / name)
            weight_map.update({k: name for k in keys})
        if n > 1:
            index = {"metadata": {"total_size": self.total}, "weight_map": dict(sorted(weight_map.items()))}
            (self.dir / f"{stem}.{ext}.index.json").write_text(json.dumps(index, indent=2))
        return names


def _full(value: torch.Tensor) -> torch.Tensor:
    """The whole tensor (a DTensor gathered; a QLoRA NF4 weight gathered as 4-bit and dequantised)."""
    from torch.distributed.tensor import DTensor

    if is_nf4(value):
        return dequantize(value)
    return value.full_tensor() if isinstance(value, DTensor) else value


def save_hf_model(
    model: nn.Module,
    save_directory: str | os.PathLike,
    is_main: bool,
    tokenizer=None,
    *,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
    dtype: torch.dtype | None = None,
    safe_serialization: bool = True,
    merge_adapter: bool = False,
) -> None:
    """Write a consolidated HF directory from a parallelised (FSDP2 / TP / DP / plain) model.
    Collective: every rank must call it; only ``is_main`` writes. ``dtype`` casts (default: as is);
    ``safe_serialization=False`` writes ``pytorch_model*.bin`` instead of safetensors. A LoRA
    ``PeftModel`` is written as a PEFT adapter directory, or with ``merge_adapter`` as the plain
    model with every adapter merged into its base weight (``W + scaling · B @ A``, per expert for
    ``target_parameters``) and the trained ``modules_to_save`` copies in place of the originals; a QLoRA
    base's
    NF4 weights are written dequantised (merged or not): the weights the adapter was trained on."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    if is_peft_model(model) and not merge_adapter:
        return save_adapter(model, save_directory, is_main, tokenizer)
    model = base_model_of(model)
    state = get_model_state_dict(model)  # sharded: nothing is gathered here
    aliases = tied_aliases(model) | pipeline_tied_copies(model)
    merges = merge_specs(model)
    seen: set[int] = set()
    names = []
    for name, value in state.items():
        if not (name in aliases or id(value) in seen or is_adapter_param(name) or is_frozen_original(name)):
            seen.add(id(value))
            names.append(name)

    def gathered(name: str) -> torch.Tensor:
        value = state[name]
        if name in merges:  # in fp32, then cast; A and B are small
            spec = merges[name]
            full = merged_weight(_full(value), _full(state[spec.a]), _full(state[spec.b]), spec)
            return full.to(dtype or value.dtype)
        if dtype is not None and value.is_floating_point() and not is_nf4(value):
            return _full(value.to(dtype))  # cast the local shard first: the gather moves dtype's bytes
        return _full(value)  # one tensor at a time

    if is_pipeline_view(model):  # every stage's tensors, streamed to the first stage
        stream = stage_tensors(model, state, names, gathered, dtype)
        names = [n for n, _, _ in stage_names(model, state, names, dtype)]
    else:
        stream = ((name, gathered(name)) for name in names)
    writer = None
    if is_main:
        conversion = SaveConversion(model, [checkpoint_key(n) for n in names])
        writer = ShardWriter(save_directory, max_shard_size, safe=safe_serialization, conversion=conversion)
    saved_dtype = None
    for name, full in stream:
        if writer is not None:
            full = full.detach().to("cpu", dtype=dtype or full.dtype)
            saved_dtype = saved_dtype or (full.dtype if full.is_floating_point() else None)
            writer.add(checkpoint_key(name), full)
        del full
    if writer is None:
        return
    writer.finish()
    out = Path(save_directory)
    if getattr(model, "config", None) is not None:
        write_hf_config(model, out, saved_dtype, model_class_name(model))
    gen = getattr(model, "generation_config", None)
    if gen is not None and getattr(model, "can_generate", lambda: False)():
        gen.save_pretrained(out)
    save_tokenizer(tokenizer, out)


# ------------------------------------------------------------------- checkpoint -> HF offline
def _load_config(model_config: Any, checkpoint_dir: Path):
    from transformers import AutoConfig, PretrainedConfig

    if isinstance(model_config, PretrainedConfig):
        return model_config
    if model_config is None:
        hf = checkpoint_dir / HF_CONFIG_DIR
        if not (hf / "config.json").is_file():
            raise ValueError(
                f"checkpoint {checkpoint_dir} has no {HF_CONFIG_DIR}/config.json: pass the model "
                "config (--config: an HF model dir, a config.json or a preset name)"
            )
        return AutoConfig.from_pretrained(hf)

    if is_preset(str(model_config)):
        return preset_config(str(model_config))
    path = Path(model_config)
    return AutoConfig.from_pretrained(path.parent if path.name.endswith(".json") else path)


def export_checkpoint(
    checkpoint_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    model_config: Any = None,
    *,
    tokenizer: Any = None,
    dtype: torch.dtype | None = None,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
) -> Path:
    """Convert checkpoint ``checkpoint_dir`` (any layout, any world size) to an HF directory on one
    process. ``model_config``: an HF config, dir, config.json or preset name (default: the config
    stored in the checkpoint). ``tokenizer``: an object with ``save_pretrained`` or a path."""
    import torch.distributed.checkpoint as dcp

    from ndparallel.models.multimodal import causal_lm_from_config

    ckpt, out = Path(checkpoint_dir), Path(out_dir)
    if is_adapter_checkpoint(ckpt):  # a LoRA run: its checkpoints hold the adapter only
        return export_adapter_checkpoint(ckpt, out, tokenizer=tokenizer, dtype=dtype)
    problems = validate_checkpoint(ckpt)
    if problems:
        raise ValueError(f"cannot export {ckpt}: " + "; ".join(problems))
    config = _load_config(model_config, ckpt)
    with torch.device("meta"):
        skeleton = causal_lm_from_config(config)
    expected = [n for n in skeleton.state_dict() if n not in tied_aliases(skeleton)]
    metadata = read_dcp_metadata(ckpt).state_dict_metadata
    prefix = "model/"
    missing = [n for n in expected if prefix + n not in metadata]
    if missing:
        raise ValueError(
            f"checkpoint {ckpt} does not match the model config: missing {missing[:5]}"
            + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        )
    shapes = skeleton.state_dict()
    wrong = [n for n in expected if list(metadata[prefix + n].size) != list(shapes[n].shape)]
    if wrong:
        n = wrong[0]
        raise ValueError(
            f"checkpoint {ckpt} does not match the model config: tensor {n!r} has shape "
            f"{list(metadata[prefix + n].size)} in the checkpoint, {list(shapes[n].shape)} in "
            "the config" + (f" (and {len(wrong) - 1} more)" if len(wrong) > 1 else "")
        )
    writer = ShardWriter(out, max_shard_size, conversion=SaveConversion(skeleton, expected))
    limit = writer.max
    group: list[str] = []
    group_bytes = 0

    def load_group(names: list[str]) -> None:
        targets = {}
        for n in names:
            md = metadata[prefix + n]
            targets[prefix + n] = torch.empty(md.size, dtype=md.properties.dtype)
        with warnings.catch_warnings():  # "assuming ... a single process": yes, on purpose
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(targets, storage_reader=SafeFileSystemReader(ckpt), no_dist=True)
        for n in names:
            t = targets.pop(prefix + n)
            writer.add(n, t.to(dtype) if dtype is not None and t.is_floating_point() else t)

    for name in expected:
        md = metadata[prefix + name]
        nbytes = md.size.numel() * torch.empty((), dtype=md.properties.dtype).element_size()
        if group and group_bytes + nbytes > limit:
            load_group(group)
            group, group_bytes = [], 0
        group.append(name)
        group_bytes += nbytes
    if group:
        load_group(group)
    writer.finish()
    floating = [
        metadata[prefix + n].properties.dtype
        for n in expected
        if metadata[prefix + n].properties.dtype.is_floating_point
    ]
    write_hf_config(config, out, dtype or (floating[0] if floating else None), model_class_name(skeleton))
    copy_generation_config(ckpt / HF_CONFIG_DIR, out)
    save_tokenizer(tokenizer, out)
    return out
