"""Load a Hugging Face causal LM straight into its parallel layout.

A model directory is built on the meta device, parallelised there (TP → CP → FSDP, no memory),
given empty storage on the device, and then filled with only this rank's shards
(``models.safetensors_read``: DCP resharding, ``pread`` into each shard).
Non-persistent buffers (rotary ``inv_freq``), which are in no checkpoint, are recomputed by the
model's own ``_init_weights``.

A config or preset name gives a random initialisation that equals
``torch.manual_seed(seed); AutoModelForCausalLM.from_config(config)`` on one process. It is built
in full on every rank and then sharded: simple and exactly reproducible, fine for the tiny presets,
but it costs the whole model per rank (meant for demos and tests, not for random-initialising a
large model).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig

from ndparallel.models.adapter_files import read_adapter_weights
from ndparallel.models.adapters import (
    adapter_config_of,
    apply_adapter,
    base_model_of,
    initial_adapter_weights,
)
from ndparallel.models.causal import causal_lm_problem, config_problem
from ndparallel.models.presets import PRESETS, is_preset, preset_config
from ndparallel.models.quantization_config import as_nf4_config
from ndparallel.models.quantized import NF4Config, nf4_parameter_names, quantize_linears
from ndparallel.models.quantized_loading import load_nf4_weights
from ndparallel.models.safetensors_read import load_sharded_safetensors
from ndparallel.models.vocab import (
    grow_config_vocab,
    set_grown_rows,
    vocab_weight_names,
)
from ndparallel.models.weights import weights_problem

_SAFETENSORS = ".safetensors"


def load_model(
    acc: Any,
    path_or_config: str | os.PathLike | PretrainedConfig,
    dtype: torch.dtype = torch.float32,
    trust_remote_code: bool = False,
    attn_implementation: str = "sdpa",
    seed: int = 0,
    adapter: Any = None,
    adapter_weights: str | os.PathLike | None = None,
    vocab_size: int | None = None,
    quantization: Any = None,
) -> nn.Module:
    """Build, parallelise (``acc.prepare_model``) and fill a causal LM; returns the prepared model.

    Args:
        acc: the ``Accelerator`` (its layout, mesh and device are used).
        path_or_config: an HF model directory with ``*.safetensors`` (one file or sharded), an HF
            ``PretrainedConfig``, or a built-in preset name (``ndparallel.models.presets``).
        dtype: parameter dtype (checkpoint tensors are converted while being copied in).
        trust_remote_code: passed to ``AutoConfig`` / ``AutoModelForCausalLM``.
        attn_implementation: the attention kernel name given to transformers.
        seed: RNG seed of the random init of a config/preset (the global RNG is left untouched)
            and of the LoRA adapter's A matrices.
        adapter: a peft ``LoraConfig``: the model is wrapped (``get_peft_model``) before it is
            parallelised; the base weights are frozen and keep ``dtype``, the adapters are fp32.
            A model read from disk starts with A drawn from ``seed`` and B = 0 on every layout.
        adapter_weights: a saved PEFT adapter directory whose tensors replace that init (continue
            training an adapter; ``adapter`` must be its config: ``adapter_files.read_adapter_config``).
        vocab_size: a model read from disk grows to this many token rows (tokens added to its
            tokenizer); the new embedding and LM-head rows start at the mean of the old ones
            (``models.vocab``). A config or preset is built with its own ``vocab_size``.
        quantization: QLoRA's 4-bit NF4 base (``quantized.NF4Config()``, ``"nf4"`` or transformers'
            ``BitsAndBytesConfig(load_in_4bit=True)``; needs ``adapter``): the base linears are
            stored as torchao ``NF4Tensor`` shards, each rank quantising only its rows while reading
            them (``quantized_loading``); computed in ``dtype`` or the mixed-precision dtype.
    """
    quantization = _check_quantization(quantization, adapter)
    if adapter_weights is not None and adapter is None:
        raise ValueError("adapter_weights needs adapter= (the LoraConfig it was saved with: "
                         "ndparallel.models.adapter_files.read_adapter_config(directory))")
    if isinstance(path_or_config, PretrainedConfig):
        config = path_or_config
    elif isinstance(path_or_config, str) and is_preset(path_or_config):
        config = preset_config(path_or_config)
    else:
        path = resolve_model_dir(str(path_or_config), acc is None or acc.is_local_main_process)
        model = _load_pretrained(acc, path, dtype, trust_remote_code, attn_implementation, adapter, seed,
                                 adapter_weights, vocab_size, quantization)
        if adapter is not None:  # as given (a hub id stays a hub id), for the saved adapter_config
            adapter_config_of(model).base_model_name_or_path = str(path_or_config)
        return model
    _check_causal_lm(config, trust_remote_code)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(
            config, dtype=dtype, attn_implementation=attn_implementation,
            trust_remote_code=trust_remote_code,
        )
        _check_causal_model(model)
        if adapter is not None:  # PEFT's own init, drawn from the same seeded stream
            model = apply_adapter(model, adapter)
        if quantization is not None:  # the whole model is on every rank here: quantise it whole
            quantize_linears(model, quantization)
    model = acc.prepare_model(model)
    if adapter_weights is not None:
        _set_full_tensors(model, read_adapter_weights(model, adapter_weights))
    return model


def _load_pretrained(
    acc: Any, path: Path, dtype: torch.dtype, trust_remote_code: bool, attn_implementation: str,
    adapter: Any = None, seed: int = 0, adapter_weights: str | os.PathLike | None = None,
    vocab_size: int | None = None, quantization: NF4Config | None = None,
) -> nn.Module:
    files = checkpoint_files(path)
    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    _check_causal_lm(config, trust_remote_code)
    grow = grow_config_vocab(config, vocab_size, adapter is not None)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(
            config, dtype=dtype, attn_implementation=attn_implementation,
            trust_remote_code=trust_remote_code,
        )
    _check_causal_model(model)
    grown = vocab_weight_names(model) if grow else []
    problem = weights_problem(model, files, str(path / "config.json"), grown=grown)  # headers only
    if problem:
        raise ValueError(f"base model {str(path)!r}: {problem}")
    if adapter is not None:
        model = apply_adapter(model, adapter)  # on meta too: LoRA layers hold no data yet
    if quantization is not None:  # NF4 placeholders on meta: the strategies shard their packed bytes
        quantize_linears(model, quantization)
    model = acc.prepare_model(model)  # TP/CP/FSDP on meta: no memory yet
    offload = getattr(getattr(acc, "fsdp_options", None), "cpu_offload", False)
    # Shards are materialised where they live: FSDP's CPU offload keeps them in host memory.
    _to_empty_keeping_ties(model, torch.device("cpu") if offload else acc.device)
    if offload:
        _move_buffers(model, acc.device)
    base = base_model_of(model)
    init_non_persistent_buffers(base)
    nf4 = set(nf4_parameter_names(base))
    load_sharded_safetensors(base, path, files, skip=set(grown) | nf4)
    if nf4:  # this rank's rows, read and quantised one decoder layer at a time
        load_nf4_weights(base, path, files, quantization, dtype, acc.device)
    if grown:
        set_grown_rows(base, files, grown, config.vocab_size)
    if adapter_weights is not None:
        _set_full_tensors(model, read_adapter_weights(model, adapter_weights))
    elif adapter is not None:
        _set_full_tensors(model, initial_adapter_weights(model, seed))
    if (path / "generation_config.json").is_file():
        from transformers import GenerationConfig

        base.generation_config = GenerationConfig.from_pretrained(path)
    return model


def _check_quantization(quantization: Any, adapter: Any) -> NF4Config | None:
    quantization = as_nf4_config(quantization)
    if quantization is not None and adapter is None:
        raise ValueError("quantization (a 4-bit NF4 base) needs adapter= (a LoraConfig): the quantised base is "
                         "frozen, only adapters train on it (QLoRA)")
    return quantization


def _set_full_tensors(model: nn.Module, full: dict[str, torch.Tensor]) -> None:
    """Copy full tensors (the same on every rank; small: LoRA adapters) into the matching,
    possibly sharded, parameters, each rank keeping its slice (DCP distributes rank 0's values)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
    )

    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, strict=False))


def _to_empty_keeping_ties(model: nn.Module, device: torch.device) -> None:
    """``model.to_empty(device)`` without breaking tied parameters: meta → real storage is no
    shallow copy, so plain ``to_empty`` gives each alias of a tied weight its own new Parameter.
    Swapping tensors in place (``swap_tensors``) keeps every Parameter object, hence the ties
    (and FSDP2's references to its sharded parameters)."""
    old = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        model.to_empty(device=device)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(old)


def _move_buffers(model: nn.Module, device: torch.device) -> None:
    for module in model.modules():
        for name, b in module.named_buffers(recurse=False):
            if b is not None and b.device != device:
                module._buffers[name] = b.to(device)


_HUB_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.tiktoken"]


def resolve_model_dir(name: str, is_local_main: bool) -> Path:
    """A local directory as is; a Hugging Face Hub id (``org/name``) downloaded (safetensors,
    config and tokenizer files only) into the HF cache, by each node's local rank 0 first while
    the other local ranks wait, then found in the cache by them without network."""
    path = Path(name).expanduser()
    if path.exists() or name.startswith((".", "/", "~")) or name.count("/") != 1:
        return path
    import torch.distributed as dist
    from huggingface_hub import snapshot_download

    def download(offline: bool) -> Path:
        return Path(snapshot_download(name, allow_patterns=_HUB_PATTERNS, local_files_only=offline))

    result: Path | Exception | None = None
    if is_local_main:
        try:
            result = download(offline=False)
        except Exception as e:  # noqa: BLE001 - reported below, after the other ranks are released
            result = e
    if dist.is_initialized():  # a 140 GB download outlasts the collective timeout: wait on a long one
        from ndparallel.runtime.distributed import long_wait_group

        dist.barrier(group=long_wait_group())
    if not is_local_main:
        try:
            result = download(offline=True)
        except Exception as e:  # noqa: BLE001
            result = e
    if isinstance(result, Exception):
        raise FileNotFoundError(
            f"base model {name!r} is not a local directory and could not be fetched from the "
            f"Hugging Face Hub ({type(result).__name__}: {result}). Download it where the Hub is "
            f"reachable (`huggingface-cli download {name} --local-dir DIR`) and give DIR instead."
        ) from None
    return result


def checkpoint_files(path: Path) -> list[Path]:
    """The ``*.safetensors`` files of model directory ``path``; clear errors when there are none."""
    if not path.exists():
        presets = ", ".join(PRESETS)
        raise FileNotFoundError(
            f"model path {str(path)!r} does not exist (and is not a built-in preset: {presets}). "
            "Give a local Hugging Face model directory (download hub models first, e.g. "
            "`huggingface-cli download <repo> --local-dir <dir>`)."
        )
    if not path.is_dir():
        raise NotADirectoryError(f"model path {str(path)!r} is not a directory: give the model directory")
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{str(path)!r} has no config.json: not a Hugging Face model directory")
    files = sorted(p for p in path.iterdir() if p.name.endswith(_SAFETENSORS))
    if not files:
        pickled = sorted(p.name for p in path.iterdir() if p.suffix in (".bin", ".pt", ".pth"))
        hint = (
            f" It holds {', '.join(pickled)}: pickled weights are never loaded (unpickling runs "
            "code). Convert once with transformers: `AutoModelForCausalLM.from_pretrained(dir)"
            ".save_pretrained(out_dir)` (writes safetensors)."
            if pickled else ""
        )
        raise FileNotFoundError(f"no *.safetensors weights in {str(path)!r}.{hint}")
    return files


def _check_causal_lm(config: PretrainedConfig, trust_remote_code: bool) -> None:
    problem = config_problem(config, trust_remote_code)
    if problem:
        raise ValueError(problem)


def _check_causal_model(model: nn.Module) -> None:
    problem = causal_lm_problem(model)
    if problem:
        raise ValueError(problem)


@torch.no_grad()
def init_non_persistent_buffers(model: nn.Module) -> None:
    """Recompute buffers that are in no checkpoint (e.g. rotary ``inv_freq``) after ``to_empty``,
    with the model's own ``_init_weights``, called only on modules that own such buffers (so no
    parameter is re-initialised)."""
    init = getattr(model, "_init_weights", None)
    for name, module in model.named_modules():
        if not getattr(module, "_non_persistent_buffers_set", None):
            continue
        if init is None:
            raise RuntimeError(f"cannot recompute the non-persistent buffers of {name!r}: no _init_weights")
        init(module)
