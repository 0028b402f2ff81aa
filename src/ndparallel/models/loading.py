"""Load a Hugging Face causal LM straight into its parallel layout.

A model directory is built on the meta device, parallelised there (``parallelize_model``, no memory),
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
from transformers import AutoConfig, PretrainedConfig

from ndparallel.models.adapter_files import read_adapter_weights
from ndparallel.models.adapters import (
    apply_adapter,
    base_model_of,
    initial_adapter_weights,
    is_peft_model,
)
from ndparallel.models.causal import causal_lm_problem, config_problem
from ndparallel.models.checkpoint_formats import drop_dequantized_config
from ndparallel.models.multimodal import causal_lm_from_config
from ndparallel.models.presets import PRESETS
from ndparallel.models.quantized import NF4Config, nf4_parameter_names, quantize_linears
from ndparallel.models.quantized_loading import load_nf4_weights
from ndparallel.models.safetensors_read import load_sharded_safetensors
from ndparallel.models.vocab import (
    grow_config_vocab,
    set_grown_rows,
    vocab_weight_names,
)
from ndparallel.models.weights import weights_problem
from ndparallel.runtime.distributed import long_wait_group

_SAFETENSORS = ".safetensors"


def build_from_config(
    config: PretrainedConfig,
    dtype: torch.dtype,
    attn_implementation: str | None,
    trust_remote_code: bool,
    seed: int,
    adapter: Any = None,
    quantization: NF4Config | None = None,
) -> nn.Module:
    """A random initialisation equal to ``torch.manual_seed(seed); from_config(config)`` on one
    process (the global RNG is left untouched), checked to be a causal LM; ``adapter`` wraps it
    with LoRA, PEFT's init drawn from the same seeded stream; ``quantization`` (QLoRA) stores its
    linears as NF4, each quantised whole. Built whole on the CPU: meant for presets and tests, not
    for random-initialising a large model."""
    _check_causal_lm(config, trust_remote_code)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = causal_lm_from_config(
            config,
            dtype=dtype,
            attn_implementation=attn_implementation,
            trust_remote_code=trust_remote_code,
        )
        _check_causal_model(model)
        if adapter is not None:
            model = apply_adapter(model, adapter)
        if quantization is not None:
            quantize_linears(model, quantization)
    return model


def build_on_meta_from_config(
    config: PretrainedConfig,
    dtype: torch.dtype,
    attn_implementation: str | None,
    trust_remote_code: bool = False,
    adapter: Any = None,
) -> nn.Module:
    """The model of ``config`` on the meta device (no memory), checked to be a causal LM;
    ``adapter`` wraps it with LoRA (on meta too)."""
    _check_causal_lm(config, trust_remote_code)
    with torch.device("meta"):
        model = causal_lm_from_config(
            config,
            dtype=dtype,
            attn_implementation=attn_implementation,
            trust_remote_code=trust_remote_code,
        )
    _check_causal_model(model)
    return apply_adapter(model, adapter) if adapter is not None else model


def build_on_meta(
    path: Path,
    dtype: torch.dtype,
    attn_implementation: str | None,
    trust_remote_code: bool,
    vocab_size: int | None = None,
    adapter: Any = None,
    config_overrides: dict | None = None,
    quantization: NF4Config | None = None,
) -> tuple[nn.Module, list[Path], list[str]]:
    """The model of directory ``path`` on the meta device (no memory), checked against its
    safetensors headers; grown to ``vocab_size`` token rows when the tokenizer outgrew it; with
    ``quantization`` (QLoRA) NF4 placeholders for its linears (the strategies shard their packed
    bytes; ``fill_from_files`` quantises each rank's rows). Returns (model, weight files, names of
    the grown weights)."""
    files = checkpoint_files(path)
    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    for key, value in (config_overrides or {}).items():  # Axolotl's overrides_of_model_config
        setattr(config, key, value)
    drop_dequantized_config(config)  # MXFP4 experts are dequantised on load (checkpoint_formats)
    _check_causal_lm(config, trust_remote_code)
    grow = grow_config_vocab(config, vocab_size, adapter is not None)
    with torch.device("meta"):
        model = causal_lm_from_config(
            config,
            dtype=dtype,
            attn_implementation=attn_implementation,
            trust_remote_code=trust_remote_code,
        )
    _check_causal_model(model)
    grown = vocab_weight_names(model) if grow else []
    problem = weights_problem(model, files, str(path / "config.json"), grown=grown)  # headers only
    if problem:
        raise ValueError(f"base model {str(path)!r}: {problem}")
    if adapter is not None:
        model = apply_adapter(model, adapter)  # on meta too: LoRA layers hold no data yet
    if quantization is not None:
        quantize_linears(model, quantization)
    return model, files, grown


def fill_from_files(
    model: nn.Module,
    path: Path,
    files: list[Path],
    grown: list[str],
    seed: int = 0,
    adapter_weights: str | os.PathLike | None = None,
    device: torch.device | None = None,
) -> None:
    """Fill a materialised (``materialize``, non-persistent buffers computed:
    ``init_non_persistent_buffers``), possibly parallelised model from the files of ``path``: this
    rank's shards only; grown token rows = the mean row; QLoRA's NF4 weights read and quantised one
    decoder layer at a time (on ``device``); LoRA adapters from ``adapter_weights`` or initialised
    from ``seed``; the directory's generation config."""
    base = base_model_of(model)
    nf4 = set(nf4_parameter_names(base))
    load_sharded_safetensors(base, path, files, skip=set(grown) | nf4)
    if nf4:  # this rank's rows, read and quantised one decoder layer at a time
        load_nf4_weights(base, path, files, device)
    if grown:
        set_grown_rows(base, files, grown, base.config.get_text_config().vocab_size)
    if adapter_weights is not None:
        set_full_tensors(model, read_adapter_weights(model, adapter_weights))
    elif is_peft_model(model):
        set_full_tensors(model, initial_adapter_weights(model, seed))
    if (path / "generation_config.json").is_file():
        from transformers import GenerationConfig

        base.generation_config = GenerationConfig.from_pretrained(path)


def set_full_tensors(model: nn.Module, full: dict[str, torch.Tensor]) -> None:
    """Copy full tensors (the same on every rank; small: LoRA adapters) into the matching,
    possibly sharded, parameters, each rank keeping its slice (DCP distributes rank 0's values)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
    )

    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, strict=False))


def materialize(model: nn.Module, device: torch.device) -> None:
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


_HUB_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.tiktoken"]


def resolve_model_dir(name: str, is_local_main: bool, revision: str | None = None) -> Path:
    """A local directory as is; a Hugging Face Hub id (``org/name``, at ``revision``: a branch, tag
    or commit; default main) downloaded (safetensors, config and tokenizer files only) into the HF
    cache, by each node's local rank 0 first while the other local ranks wait, then found in the
    cache by them without network."""
    path = Path(name).expanduser()
    if path.exists() or name.startswith((".", "/", "~")) or name.count("/") != 1:
        return path
    import torch.distributed as dist
    from huggingface_hub import snapshot_download

    def download(offline: bool) -> Path:
        return Path(
            snapshot_download(name, revision=revision, allow_patterns=_HUB_PATTERNS, local_files_only=offline)
        )

    result: Path | Exception | None = None
    if is_local_main:
        try:
            result = download(offline=False)
        except Exception as e:  # noqa: BLE001 - reported below, after the other ranks are released
            result = e
    if dist.is_initialized():  # a 140 GB download outlasts the collective timeout: wait on a long one
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
            f"reachable (`hf download {name}{f' --revision {revision}' if revision else ''} --local-dir "
            f"DIR`) "
            "and give DIR instead."
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
            if pickled
            else ""
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
