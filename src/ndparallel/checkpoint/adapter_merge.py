"""Merge a saved PEFT LoRA adapter into its base model offline, on one process, streaming: each base
tensor is read from the base's safetensors, merged (``W + scaling · B @ A`` in fp32, then cast;
per expert for ``target_parameters``) when LoRA adapted it, replaced by the adapter's trained copy
for ``modules_to_save``, and handed to the shard writer. Peak host memory: one output shard
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
from transformers import AutoConfig

from ndparallel.checkpoint.directory import STATE_FILE
from ndparallel.checkpoint.export import ShardWriter
from ndparallel.checkpoint.hf_files import (
    copy_generation_config,
    save_tokenizer,
    write_hf_config,
)
from ndparallel.checkpoint.io import read_json
from ndparallel.models.adapter_files import (
    ADAPTER_WEIGHTS,
    adapter_weights_problem,
    read_adapter_config,
)
from ndparallel.models.adapters import (
    apply_adapter,
    checkpoint_key,
    is_saved_module_param,
    merge_specs,
    merged_weight,
    peft_save_key,
)
from ndparallel.models.key_conversion import SaveConversion, checkpoint_keys
from ndparallel.models.loading import checkpoint_files, resolve_model_dir
from ndparallel.models.multimodal import causal_lm_from_config
from ndparallel.models.naming import model_class_name
from ndparallel.models.presets import is_preset
from ndparallel.models.quantization_config import nf4_config_from_bnb
from ndparallel.models.quantized import NF4Config, quantized_linears, require_torchao
from ndparallel.models.safetensors_read import stored_tensors
from ndparallel.models.weights import weights_problem

PEFT_PREFIX = "base_model.model."


def _base_dir(adapter_config, base: str | os.PathLike | None) -> Path:
    name = str(base) if base is not None else (adapter_config.base_model_name_or_path or "")
    if not name or is_preset(name):
        why = f"the built-in preset {name!r} (random weights, not on disk)" if name else "not recorded"
        raise ValueError(
            f"the adapter's base model is {why}: pass --base DIR (the Hugging Face model "
            "directory it was trained on), or merge while training (merge_lora: true)"
        )
    # the Hub revision the adapter was trained on (revision_of_model), unless --base names the base
    revision = getattr(adapter_config, "revision", None) if base is None else None
    return resolve_model_dir(name, True, revision)


def checkpoint_quantization(checkpoint_dir: str | os.PathLike):
    """(``NF4Config``, dtype the run quantised in) of a QLoRA run's checkpoint (its resolved config
    says ``load_in_4bit``); (None, None) for any other."""

    state = Path(checkpoint_dir) / STATE_FILE
    config = (read_json(state).get("config") or {}) if state.is_file() else {}
    if not config.get("load_in_4bit"):
        return None, None
    nf4 = NF4Config(config.get("nf4_block_size", 64), config.get("nf4_scaler_block_size", 256))
    nf4 = nf4_config_from_bnb({"load_in_4bit": True, **(config.get("bnb_config_kwargs") or {})}, nf4)
    return nf4, torch.bfloat16 if config.get("bf16") else torch.float32


def _nf4_round_trip(t: torch.Tensor, nf4, dtype: torch.dtype | None) -> torch.Tensor:
    """What a QLoRA run computed with: ``t`` quantised to NF4 (in the run's load dtype) and back."""

    _, to_nf4 = require_torchao()
    q = t.to(dtype or t.dtype)
    return to_nf4(q, nf4.block_size, nf4.scaler_block_size).get_original_weight().to(t.dtype)


class _FusedMerges:
    """Adapted model tensors the base stores as several tensors (transformers 5 MoE families keep
    one tensor per expert on disk and fuse them on load, ``models.key_conversion``): each is built
    as transformers builds it, merged, and split back into the stored tensors as ``save_pretrained``
    does. Memory: one fused tensor (all experts of one weight of one layer) at a time."""

    def __init__(self, model, stored: dict, merges: dict):

        plan = checkpoint_keys(model, {k: (v[0], v[1]) for k, v in stored.items()})
        self.groups = {k: plan.fused[k] for k in merges if k in plan.fused}
        self.sources = {s: k for k, g in self.groups.items() for keys in g.sources.values() for s in keys}
        self._model, self._stored, self._merges = model, stored, merges
        self._revert = SaveConversion(model, list(self.groups))
        self._done: set[str] = set()

    def _read(self, key: str) -> torch.Tensor:
        with safe_open(str(self._stored[key][2]), framework="pt") as f:
            return f.get_tensor(key)

    def merge(self, stored_key: str, adapter: dict) -> dict[str, torch.Tensor]:
        """The merged stored tensors of ``stored_key``'s group, once (later members: nothing)."""
        target = self.sources[stored_key]
        if target in self._done:
            return {}
        self._done.add(target)
        spec = self._merges[target]
        shape = self.groups[target].shapes[target]
        full = self.groups[target].read(self._model, target, [0] * len(shape), list(shape), self._read)
        return self._revert.add(target, merged_weight(full, adapter[spec.a], adapter[spec.b], spec))


def _adapted_keys(peft_model) -> tuple[dict, dict]:
    """The base's checkpoint keys the adapter changes: those merged (key -> merge spec naming the
    adapter file's A and B keys) and those it replaces whole (key -> the adapter file's key)."""
    merges = {
        checkpoint_key(w): spec._replace(
            a=peft_save_key(PEFT_PREFIX + spec.a), b=peft_save_key(PEFT_PREFIX + spec.b)
        )
        for w, spec in merge_specs(peft_model.get_base_model()).items()
    }
    # modules_to_save: the adapter holds the trained module whole, under the base's own key
    replaced = {
        checkpoint_key(n): peft_save_key(PEFT_PREFIX + n)
        for n, _ in peft_model.get_base_model().named_parameters()
        if is_saved_module_param(n)
    }
    return merges, replaced


def merge_adapter_files(
    adapter_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    base: str | os.PathLike | None = None,
    dtype: torch.dtype | None = None,
    max_shard_size: int | str = "5GB",
    tokenizer=None,
    nf4=None,
    nf4_dtype: torch.dtype | None = None,
) -> Path:
    """Write ``base`` (default: the adapter's ``base_model_name_or_path``) with the adapter of
    ``adapter_dir`` merged in, as a plain HF safetensors directory ``out_dir``. ``dtype`` casts the
    floating tensors (default: the base's own). ``nf4`` (an ``NF4Config``: a QLoRA adapter): every
    weight the run stored as NF4 is first quantised and dequantised as the run did (in ``nf4_dtype``,
    default the stored dtype), so the merge is into the weights the adapter was trained on. Raises
    ``ValueError`` before writing anything when the adapter does not fit the base."""
    lora = read_adapter_config(adapter_dir)
    base_dir = _base_dir(lora, base)
    files = checkpoint_files(base_dir)
    hf_config = AutoConfig.from_pretrained(base_dir)
    with torch.device("meta"):
        skeleton = causal_lm_from_config(hf_config)
    class_name = model_class_name(skeleton)
    problem = weights_problem(skeleton, files, str(base_dir / "config.json"))  # headers only
    if problem:
        raise ValueError(f"base {base_dir}: {problem}")
    quantised = set()
    if nf4 is not None:
        quantised = {f"{n}.weight" for n in quantized_linears(skeleton, nf4)[0]}
    peft_model = apply_adapter(skeleton, lora)
    problem = adapter_weights_problem(peft_model, adapter_dir)
    if problem:
        raise ValueError(f"{problem} (base {base_dir})")
    merges, replaced = _adapted_keys(peft_model)
    stored = stored_tensors(files)
    fused = _FusedMerges(peft_model.get_base_model(), stored, merges)
    missing = sorted((set(merges) | set(replaced)) - set(stored) - set(fused.groups))
    if missing:
        raise ValueError(
            f"base {base_dir} has no tensor {missing[0]} that the adapter adapts "
            f"({len(missing)} missing): not the adapter's base model"
        )
    adapter = load_file(str(Path(adapter_dir) / ADAPTER_WEIGHTS))
    writer = ShardWriter(out_dir, max_shard_size)
    saved_dtype = None

    def add(key: str, t: torch.Tensor) -> None:
        nonlocal saved_dtype
        if dtype is not None and t.is_floating_point():
            t = t.to(dtype)
        saved_dtype = saved_dtype or (t.dtype if t.is_floating_point() else None)
        writer.add(key, t)

    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                if key in fused.sources:  # stored per expert: merged fused, written back per expert
                    for k, t in fused.merge(key, adapter).items():
                        add(k, t)
                    continue
                t = f.get_tensor(key)
                if key in quantised:
                    t = _nf4_round_trip(t, nf4, nf4_dtype)
                if key in replaced:
                    t = adapter[replaced[key]].to(t.dtype)
                elif key in merges:
                    spec = merges[key]
                    t = merged_weight(t, adapter[spec.a], adapter[spec.b], spec)
                add(key, t)
    writer.finish()
    out = Path(out_dir)
    write_hf_config(hf_config, out, saved_dtype, class_name)
    copy_generation_config(base_dir, out)
    save_tokenizer(tokenizer, out)
    return out
