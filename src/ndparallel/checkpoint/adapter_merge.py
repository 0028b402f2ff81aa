"""Merge a saved PEFT LoRA adapter into its base model offline, on one process, streaming: each base
tensor is read from the base's safetensors, merged (``W + scaling · B @ A`` in fp32, then cast)
when LoRA adapted it, and handed to the shard writer. Peak host memory: one output shard
(``max_shard_size``) + one base tensor + the adapter — not the model (``PeftModel.merge_and_unload``
needs the whole model in memory: 140 GB for 70B in bf16).

Why by hand: PEFT merges only a model it has loaded whole; no library merges file to file.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM

from ndparallel.checkpoint.export import ShardWriter
from ndparallel.checkpoint.hf_files import (
    copy_generation_config,
    save_tokenizer,
    write_hf_config,
)
from ndparallel.models.adapter_files import (
    ADAPTER_WEIGHTS,
    adapter_weights_problem,
    read_adapter_config,
)
from ndparallel.models.adapters import (
    apply_adapter,
    checkpoint_key,
    merge_specs,
    peft_save_key,
)
from ndparallel.models.loading import checkpoint_files, resolve_model_dir
from ndparallel.models.naming import model_class_name
from ndparallel.models.presets import is_preset
from ndparallel.models.weights import weights_problem

PEFT_PREFIX = "base_model.model."


def _base_dir(adapter_config, base: str | os.PathLike | None) -> Path:
    name = str(base) if base is not None else (adapter_config.base_model_name_or_path or "")
    if not name or is_preset(name):
        why = f"the built-in preset {name!r} (random weights, not on disk)" if name else "not recorded"
        raise ValueError(f"the adapter's base model is {why}: pass --base DIR (the Hugging Face model "
                         "directory it was trained on), or merge while training (merge_lora: true)")
    return resolve_model_dir(name, True)


def merge_adapter_files(adapter_dir: str | os.PathLike, out_dir: str | os.PathLike, *,
                        base: str | os.PathLike | None = None, dtype: torch.dtype | None = None,
                        max_shard_size: int | str = "5GB", tokenizer=None) -> Path:
    """Write ``base`` (default: the adapter's ``base_model_name_or_path``) with the adapter of
    ``adapter_dir`` merged in, as a plain HF safetensors directory ``out_dir``. ``dtype`` casts the
    floating tensors (default: the base's own). Raises ``ValueError`` before writing anything when
    the adapter does not fit the base."""
    lora = read_adapter_config(adapter_dir)
    base_dir = _base_dir(lora, base)
    files = checkpoint_files(base_dir)
    hf_config = AutoConfig.from_pretrained(base_dir)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(hf_config)
    class_name = model_class_name(skeleton)
    problem = weights_problem(skeleton, files, str(base_dir / "config.json"))  # headers only
    if problem:
        raise ValueError(f"base {base_dir}: {problem}")
    peft_model = apply_adapter(skeleton, lora)
    problem = adapter_weights_problem(peft_model, adapter_dir)
    if problem:
        raise ValueError(f"{problem} (base {base_dir})")
    merges = {checkpoint_key(w): (peft_save_key(PEFT_PREFIX + a), peft_save_key(PEFT_PREFIX + b), s)
              for w, (a, b, s) in merge_specs(peft_model.get_base_model()).items()}
    stored = set()
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            stored.update(f.keys())
    missing = sorted(set(merges) - stored)
    if missing:
        raise ValueError(f"base {base_dir} has no tensor {missing[0]} that the adapter adapts "
                         f"({len(missing)} missing): not the adapter's base model")
    adapter = load_file(str(Path(adapter_dir) / ADAPTER_WEIGHTS))
    writer = ShardWriter(out_dir, max_shard_size)
    saved_dtype = None
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                t = f.get_tensor(key)
                if key in merges:
                    a, b, scaling = merges[key]
                    t = (t.float() + scaling * (adapter[b].float() @ adapter[a].float())).to(t.dtype)
                if dtype is not None and t.is_floating_point():
                    t = t.to(dtype)
                saved_dtype = saved_dtype or (t.dtype if t.is_floating_point() else None)
                writer.add(key, t)
    writer.finish()
    out = Path(out_dir)
    write_hf_config(hf_config, out, saved_dtype, class_name)
    copy_generation_config(base_dir, out)
    save_tokenizer(tokenizer, out)
    return out
