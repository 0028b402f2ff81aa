"""Checks of a training config against the world size, the model and the data, made before any
rank starts (``train``, ``--dry-run``, ``verify``), and the resolved plan ``--dry-run`` prints."""

from __future__ import annotations

import os
from pathlib import Path

from ndparallel.training.config import ConfigError, TrainConfig


def validate_layout(cfg: TrainConfig, world_size: int, check_data: bool = True):
    """Check the layout against the world size and the model (and that local data exists) before
    any rank starts. Returns (resolved ParallelismConfig, HF model config)."""
    from ndparallel.layout.config import ParallelismConfigError
    from ndparallel.training.build import model_config

    try:
        pc = cfg.parallelism_config().resolve(world_size)
    except ParallelismConfigError as e:
        raise ConfigError(str(e)) from None
    # A well-known hub id that is not on disk is validated with its published numbers: no network
    # round trip (or long retries on an offline machine) before the ranks start.
    hf = None if Path(cfg.base_model).exists() else known_config_offline(cfg.base_model)
    if hf is None:
        try:
            hf = model_config(cfg, vocab_size=cfg.tokenizer_vocab_size)
        except (OSError, ValueError) as e:
            raise ConfigError(f"base_model={cfg.base_model!r} cannot be read: {e}") from None
    if check_data:
        _check_datasets(cfg)
    try:
        if pc.tp_enabled:
            from ndparallel.parallel.tensor import validate_tensor_parallel

            validate_tensor_parallel(hf, pc.tp_size, cfg.tp_options())
        if pc.cp_enabled:
            from ndparallel.parallel.context import validate_context_parallel

            validate_context_parallel(hf, pc.cp_size, cfg.sequence_len, pc.tp_size)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    _check_fp8(cfg)
    return pc, hf


def _check_fp8(cfg: TrainConfig) -> None:
    """fp8 needs torchao and a GPU of compute capability >= 8.9 (unless emulated)."""
    if not cfg.fp8:
        return
    import torch

    from ndparallel.parallel.float8 import float8_problem

    device = cfg.device if cfg.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    problem = float8_problem(cfg.float8_options(), device)
    if problem:
        raise ConfigError(f"fp8: {problem}")


def _check_datasets(cfg: TrainConfig) -> None:
    """Local dataset files must exist before ranks start (hub names are checked when loaded)."""
    from ndparallel.data.dataset import looks_local

    for i, d in enumerate(cfg.datasets):
        if d.path.startswith("builtin:"):
            continue
        if looks_local(d.path) and not Path(d.path).expanduser().exists():
            raise ConfigError(f"datasets[{i}].path={d.path!r} does not exist: fix the path "
                              "(relative paths are taken from the current directory)")


def known_config_offline(hub_id: str):
    """The HF config of a well-known hub model from the planner's published numbers, so a layout
    can be validated (``--dry-run``) on a machine that cannot reach the hub."""
    from ndparallel.models.presets import published_config

    return published_config(hub_id)


def world_size_for(cfg: TrainConfig, nproc: int | None) -> int:
    if "WORLD_SIZE" in os.environ:
        return int(os.environ["WORLD_SIZE"])
    sizes = [cfg.dp_replicate_size, cfg.dp_shard_size, cfg.tensor_parallel_size, cfg.context_parallel_size]
    if -1 in sizes:
        if not nproc:
            raise ConfigError("a degree is -1 (fill from the world size): pass --nproc-per-node N")
        return nproc
    total = 1
    for s in sizes:
        total *= s
    if nproc and nproc != total:
        raise ConfigError(f"--nproc-per-node {nproc} but the layout needs {total} ranks")
    return total


def describe_plan(cfg: TrainConfig, pc, hf) -> str:
    """The resolved run, as printed by ``--dry-run``."""
    gbs = cfg.micro_batch_size * cfg.gradient_accumulation_steps * pc.dp_size
    lines = [
        f"layout       : {pc.describe()}  ({pc!r})",
        f"model        : {cfg.base_model} ({hf.model_type}, {hf.num_hidden_layers} layers, hidden "
        f"{hf.hidden_size}, heads {hf.num_attention_heads}/{getattr(hf, 'num_key_value_heads', '?')})",
        f"global batch : {gbs} sequences × {cfg.sequence_len} tokens = {gbs * cfg.sequence_len} tokens/step "
        f"(micro {cfg.micro_batch_size} × accum {cfg.gradient_accumulation_steps} × dp {pc.dp_size})",
        f"per rank     : {cfg.micro_batch_size} × {cfg.sequence_len // pc.cp_size} tokens per micro-batch"
        + (f" (sequence split over cp={pc.cp_size})" if pc.cp_enabled else ""),
        f"fsdp         : {cfg.fsdp_config.model_dump()}",
        f"precision    : {'bf16 compute, fp32 master weights' if cfg.bf16 else 'fp32'}"
        + (f", fp8 linears ({cfg.fp8_recipe})" if cfg.fp8 else ""),
        f"speed        : chunked loss {_auto(cfg.chunked_loss)}, compile {'on' if cfg.compile else 'off'}"
        + (f", loss parallel {_auto(cfg.loss_parallel)}" if pc.tp_enabled else ""),
        f"steps        : {cfg.max_steps or f'{cfg.num_epochs} epochs'}; lr {cfg.learning_rate} "
        f"({cfg.lr_scheduler}, warmup {cfg.warmup_steps})",
        f"output       : {cfg.output_dir}",
    ]
    return "\n".join(lines)


def _auto(flag: bool | None) -> str:
    return "auto (on where exact)" if flag is None else ("on" if flag else "off")
