"""Build a causal LM straight into the engine's layout (torchtitan's order): on the meta device →
parallelise (no memory yet) → materialise this rank's shards where they live → read only those
shards from the safetensors files. A config or preset name is built whole, seeded, and sharded
(``models.loading.build_from_config``: for presets and tests)."""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.nn as nn
from transformers import PretrainedConfig

from ndparallel.models.adapter_files import read_adapter_weights
from ndparallel.models.adapters import adapter_config_of, base_model_of
from ndparallel.models.loading import (
    build_from_config,
    build_on_meta,
    build_on_meta_from_config,
    fill_from_files,
    init_non_persistent_buffers,
    materialize,
    resolve_model_dir,
    set_full_tensors,
)
from ndparallel.models.presets import is_preset, preset_config
from ndparallel.models.quantization_config import check_quantization
from ndparallel.parallel.parallelize import move_leftovers


def build_model(
    engine,
    source: str | os.PathLike | PretrainedConfig,
    dtype: torch.dtype = torch.float32,
    trust_remote_code: bool = False,
    attn_implementation: str | None = None,
    seed: int = 0,
    adapter: Any = None,
    adapter_weights: str | os.PathLike | None = None,
    vocab_size: int | None = None,
    config_overrides: dict | None = None,
    quantization: Any = None,
    revision: str | None = None,
) -> nn.Module:
    """Build, parallelise and fill a causal LM for ``engine`` (an ``Engine``); returns the model.

    Args:
        source: an HF model directory with ``*.safetensors`` (one file or sharded) or a hub id, an
            HF ``PretrainedConfig``, or a built-in preset name (``ndparallel.models.presets``).
        dtype: parameter dtype (checkpoint tensors are converted while being copied in).
        trust_remote_code: passed to ``AutoConfig`` / ``AutoModelForCausalLM``.
        attn_implementation: the attention kernel name given to transformers (None: the family's
            default, sdpa where transformers supports it, else eager: Gemma 2).
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
        config_overrides: fields set on the config of a model read from disk before it is built
            (Axolotl's ``overrides_of_model_config``; a config or preset: set them on it).
        quantization: QLoRA's 4-bit NF4 base (``models.quantized.NF4Config()``, ``"nf4"`` or a 4-bit
            ``BitsAndBytesConfig``; needs ``adapter``): the base linears become torchao ``NF4Tensor``
            shards, each rank quantising only its rows while reading them (``quantized_loading``).
    """
    quantization = check_quantization(quantization, adapter)
    if adapter_weights is not None and adapter is None:
        raise ValueError(
            "adapter_weights needs adapter= (the LoraConfig it was saved with: "
            "ndparallel.models.adapter_files.read_adapter_config(directory))"
        )
    if isinstance(source, PretrainedConfig) or (isinstance(source, str) and is_preset(source)):
        config = source if isinstance(source, PretrainedConfig) else preset_config(source)
        model = build_from_config(
            config, dtype, attn_implementation, trust_remote_code, seed, adapter, quantization
        )
        model = engine.parallelize(model)
        if adapter_weights is not None:
            set_full_tensors(model, read_adapter_weights(model, adapter_weights))
        return model
    path = resolve_model_dir(str(source), engine is None or engine.is_local_main_process, revision)
    model, files, grown = build_on_meta(
        path,
        dtype,
        attn_implementation,
        trust_remote_code,
        vocab_size,
        adapter,
        config_overrides,
        quantization,
    )
    model = engine.parallelize(model)  # TP/CP/FSDP on meta: no memory yet
    materialize_shards(engine, model)
    fill_from_files(model, path, files, grown, seed, adapter_weights, device=engine.device)
    if adapter is not None:  # as given (a hub id stays a hub id), for the saved adapter_config
        adapter_config_of(model).base_model_name_or_path = str(source)
    return model


def build_random_shards(
    engine,
    config: PretrainedConfig,
    dtype: torch.dtype = torch.float32,
    attn_implementation: str = "sdpa",
    trust_remote_code: bool = False,
    adapter: Any = None,
) -> nn.Module:
    """The model of ``config`` built on the meta device, parallelised, and only this rank's shards
    materialised and filled with random values (normal(0, 0.02) for matrices, ones for vectors;
    rotary buffers computed): the whole model never exists on any rank, whatever its size. For
    measuring one rank (``ndparallel simulate``), where the values do not matter."""

    model = build_on_meta_from_config(config, dtype, attn_implementation, trust_remote_code, adapter)
    model = engine.parallelize(model)
    materialize_shards(engine, model)
    fill_random(model)
    return model


def materialize_shards(engine, module: nn.Module) -> None:
    """This rank's shards of a parallelised meta ``module`` allocated where they live (on the
    device, or in host memory under FSDP's CPU offload, its buffers then on the device), and its
    non-persistent buffers (rotary frequencies) computed. A pipeline stage view: each of its
    stages' models (the view holds one copy of the buffers several stages of a rank share)."""

    offload = engine.options.fsdp.cpu_offload
    pipeline = engine.pipeline_of(module)
    for part in pipeline.lms() if pipeline is not None else [module]:
        materialize(part, torch.device("cpu") if offload else engine.device)
        if offload:
            move_leftovers(part, engine.device, keep_params_on_cpu=True)
        init_non_persistent_buffers(base_model_of(part))


def fill_random(module: nn.Module) -> None:
    """This rank's shards of every floating parameter: normal(0, 0.02) for matrices, ones for vectors."""
    with torch.no_grad():
        for p in module.parameters():
            local = p.to_local() if hasattr(p, "to_local") else p
            if local.is_floating_point():
                local.normal_(0.0, 0.02) if local.dim() > 1 else local.fill_(1.0)
