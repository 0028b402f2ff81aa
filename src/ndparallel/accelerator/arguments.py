"""Resolve the ``Accelerator`` constructor's arguments (Accelerate's 21 plus ndparallel's options)
and the environment ``accelerate launch`` sets (``ACCELERATE_*``, ``FSDP_*``,
``PARALLELISM_CONFIG_*``) into one ``Settings``. Anything that cannot be honoured raises here,
before the process group exists, with the argument named."""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch

from ndparallel.accelerator.handlers import sort_handlers
from ndparallel.accelerator.plugins import (
    DataLoaderConfiguration,
    FullyShardedDataParallelPlugin,
    GradientAccumulationPlugin,
    ProjectConfiguration,
    TorchDynamoPlugin,
    TorchTensorParallelPlugin,
    env_flag,
)
from ndparallel.layout.config import ParallelismConfig
from ndparallel.parallel.options import ActivationOptions, CPOptions, FSDPOptions, TPOptions
from ndparallel.techniques.technique_options import CompileOptions, Float8Options, LossOptions, QATOptions

MIXED_PRECISION = {"no": None, "fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
RNG_TYPES = ("torch", "cuda", "generator")
_USER = 4
"""``stacklevel`` of a warning here: the user's ``Accelerator(...)`` (its ``__init__``, ``resolve``, the
helper)."""
UNSET = object()  # Accelerate's sentinel for the deprecated ``split_batches`` argument


@dataclass
class Settings:
    parallelism_config: ParallelismConfig | None
    mixed_precision: str
    param_dtype: torch.dtype | None
    gradient_state_plugin: GradientAccumulationPlugin
    fsdp_plugin: FullyShardedDataParallelPlugin | None
    fsdp_options: FSDPOptions
    activation_options: ActivationOptions
    tp_options: TPOptions
    cp_options: CPOptions
    loss_options: LossOptions
    compile_options: CompileOptions
    float8_options: Float8Options
    qat_options: QATOptions
    dynamo_plugin: TorchDynamoPlugin
    dataloader_config: DataLoaderConfiguration
    project_configuration: ProjectConfiguration
    handlers: dict[str, Any]
    rng_types: list[str]
    log_with: Any
    device: str | None
    timeout_s: float | None
    device_placement: bool = True
    step_scheduler_with_optimizer: bool = True
    notes: list[str] = field(default_factory=list)


def _mixed_precision(value: Any) -> str:
    if value is None:
        value = os.environ.get("ACCELERATE_MIXED_PRECISION", "no")
    value = str(getattr(value, "value", value)).lower()
    if value == "fp8":
        raise ValueError(
            "mixed_precision='fp8' is not supported: use 'bf16' (fp8 needs TransformerEngine/"
            "torchao recipes ndparallel does not drive)"
        )
    if value not in MIXED_PRECISION:
        raise ValueError(f"mixed_precision={value!r} is not supported: use one of {list(MIXED_PRECISION)}")
    return "no" if value == "fp32" else value


def _refuse_other_engines(deepspeed_plugin, deepspeed_plugins, megatron_lm_plugin) -> None:
    if deepspeed_plugin is not None or deepspeed_plugins is not None or env_flag("ACCELERATE_USE_DEEPSPEED"):
        raise ValueError(
            "deepspeed_plugin / ACCELERATE_USE_DEEPSPEED is not supported: ndparallel "
            "shards with FSDP2; use fsdp_plugin=FullyShardedDataParallelPlugin(...) and "
            "ParallelismConfig(dp_shard_size=...)"
        )
    if megatron_lm_plugin is not None or env_flag("ACCELERATE_USE_MEGATRON_LM"):
        raise ValueError(
            "megatron_lm_plugin is not supported: use ParallelismConfig(tp_size=..., "
            "cp_size=...) for tensor and context parallelism"
        )


def _parallelism(pc, torch_tp_plugin) -> ParallelismConfig | None:
    if torch_tp_plugin is not None:
        if not isinstance(torch_tp_plugin, TorchTensorParallelPlugin):
            raise TypeError("torch_tp_plugin must be a TorchTensorParallelPlugin")
        warnings.warn(
            "`TorchTensorParallelPlugin` is deprecated: use ParallelismConfig(tp_size=...)",
            FutureWarning,
            stacklevel=_USER,
        )
        if pc is None:
            return ParallelismConfig(tp_size=torch_tp_plugin.tp_size)
        if pc.tp_size != torch_tp_plugin.tp_size:
            raise ValueError(
                f"torch_tp_plugin.tp_size={torch_tp_plugin.tp_size} contradicts "
                f"parallelism_config.tp_size={pc.tp_size}: pass only the ParallelismConfig"
            )
    if pc is None and env_flag("ACCELERATE_USE_PARALLELISM_CONFIG"):
        return ParallelismConfig()
    if pc is not None and not isinstance(pc, ParallelismConfig):
        raise TypeError(
            f"parallelism_config must be an ndparallel ParallelismConfig, got {type(pc).__name__}"
        )
    return pc


def _fsdp(fsdp_plugin, fsdp_options: FSDPOptions | None, activation: ActivationOptions | None):
    """(the plugin, ``FSDPOptions``, ``ActivationOptions``): Accelerate's plugin sets FSDP's options
    and activation checkpointing, ndparallel's options the rest."""
    if fsdp_plugin is None and env_flag("ACCELERATE_USE_FSDP"):
        fsdp_plugin = FullyShardedDataParallelPlugin()
    if fsdp_plugin is None:
        return None, fsdp_options or FSDPOptions(), activation or ActivationOptions()
    if not isinstance(fsdp_plugin, FullyShardedDataParallelPlugin):
        raise TypeError("`fsdp_plugin` must be a FullyShardedDataParallelPlugin object.")
    if fsdp_options is not None:
        raise ValueError("pass fsdp_plugin (Accelerate's) or fsdp_options (ndparallel's), not both")
    return fsdp_plugin, fsdp_plugin.to_options(), fsdp_plugin.activation_options(activation)


def _cp_options(pc: ParallelismConfig | None, cp_options: CPOptions | None) -> CPOptions:
    handler = pc.cp_handler if pc is not None else None
    if handler is not None and not getattr(handler, "chosen", True):
        handler = None  # nobody chose a strategy: ndparallel's default
    if cp_options is None:
        return CPOptions(comm_strategy=handler.strategy) if handler is not None else CPOptions()
    if handler is not None and handler.strategy != cp_options.comm_strategy:
        warnings.warn(
            f"cp_options.comm_strategy={cp_options.comm_strategy!r} is used; "
            f"parallelism_config.cp_handler ({handler.cp_comm_strategy!r}) is not",
            stacklevel=_USER,
        )
    return cp_options


def _tp_options(pc: ParallelismConfig | None, tp_options: TPOptions | None) -> TPOptions:
    handler = pc.tp_handler if pc is not None else None
    asked = bool(handler is not None and handler.sequence_parallel)
    if tp_options is None:
        return TPOptions(sequence_parallel=asked)
    if asked and not tp_options.sequence_parallel:
        warnings.warn(
            "tp_options.sequence_parallel=False is used; parallelism_config.tp_handler's "
            "sequence_parallel=True is not",
            stacklevel=_USER,
        )
    return tp_options


def _dataloader_config(dataloader_config, split_batches) -> DataLoaderConfiguration:
    if dataloader_config is None:
        dataloader_config = DataLoaderConfiguration()
    elif split_batches is not UNSET:
        raise ValueError("pass split_batches inside dataloader_config, not both")
    if split_batches is not UNSET:
        warnings.warn(
            "split_batches= is deprecated: use dataloader_config=DataLoaderConfiguration(...)",
            FutureWarning,
            stacklevel=_USER,
        )
        dataloader_config.split_batches = bool(split_batches)
    return dataloader_config


def _project(project_dir, project_config) -> ProjectConfiguration:
    project = project_config if project_config is not None else ProjectConfiguration(project_dir=project_dir)
    if project_dir is not None and project.project_dir is None:
        project.set_directories(project_dir)
    return project


def _rng_types(rng_types) -> list[str]:
    out = [str(getattr(r, "value", r)) for r in (rng_types if rng_types is not None else ["generator"])]
    bad = [r for r in out if r not in RNG_TYPES]
    if bad:
        raise ValueError(f"rng_types {bad} are not supported: use some of {list(RNG_TYPES)}")
    return out


def resolve(a: dict[str, Any]) -> Settings:
    """``a``: the constructor's arguments by name."""
    _refuse_other_engines(a["deepspeed_plugin"], a["deepspeed_plugins"], a["megatron_lm_plugin"])
    mp = _mixed_precision(a["mixed_precision"])
    ga = a["gradient_accumulation_plugin"]
    if ga is not None and int(a["gradient_accumulation_steps"]) != 1:
        raise ValueError(
            "You can only pass one of `gradient_accumulation_steps` and `gradient_accumulation_plugin`."
        )
    if ga is None:
        steps = a["gradient_accumulation_steps"]
        if int(steps) < 1:
            raise ValueError(f"gradient_accumulation_steps must be >= 1, got {steps}")
        env_steps = os.environ.get("ACCELERATE_GRADIENT_ACCUMULATION_STEPS")
        ga = GradientAccumulationPlugin(num_steps=int(env_steps) if env_steps else int(steps))
    if a["dynamo_plugin"] is not None and a["dynamo_backend"] is not None:
        raise ValueError(
            "You cannot pass in both `dynamo_plugin` and `dynamo_backend`, please only pass in one."
        )
    dynamo = a["dynamo_plugin"] or TorchDynamoPlugin(backend=a["dynamo_backend"])
    if a["compile_options"] is not None and dynamo.enabled:
        raise ValueError(
            "compile_options and dynamo_backend/dynamo_plugin both ask for torch.compile: give one of them"
        )
    pc = _parallelism(a["parallelism_config"], a["torch_tp_plugin"])
    fsdp_plugin, fsdp_options, activation = _fsdp(
        a["fsdp_plugin"], a["fsdp_options"], a["activation_options"]
    )
    handlers = sort_handlers(a["kwargs_handlers"])
    timeout_s = a["timeout_s"]
    if timeout_s is None and "init_handler" in handlers:
        timeout_s = handlers["init_handler"].timeout_s
    param_dtype = MIXED_PRECISION[mp]
    if fsdp_plugin is not None and fsdp_plugin.param_dtype is not None:
        param_dtype = fsdp_plugin.param_dtype
    cpu = a["cpu"] or env_flag("ACCELERATE_USE_CPU")
    return Settings(
        parallelism_config=pc,
        mixed_precision=mp,
        param_dtype=param_dtype,
        gradient_state_plugin=ga,
        fsdp_plugin=fsdp_plugin,
        fsdp_options=fsdp_options,
        activation_options=activation,
        tp_options=_tp_options(pc, a["tp_options"]),
        cp_options=_cp_options(pc, a["cp_options"]),
        dynamo_plugin=dynamo,
        loss_options=a["loss_options"] or LossOptions(),
        compile_options=a["compile_options"] or dynamo.compile_options(),
        float8_options=a["float8_options"] or Float8Options(),
        qat_options=a["qat_options"] or QATOptions(),
        dataloader_config=_dataloader_config(a["dataloader_config"], a["split_batches"]),
        project_configuration=_project(a["project_dir"], a["project_config"]),
        handlers=handlers,
        rng_types=_rng_types(a["rng_types"]),
        log_with=a["log_with"],
        device="cpu" if cpu else a["device"],
        timeout_s=timeout_s,
        device_placement=bool(a["device_placement"]),
        step_scheduler_with_optimizer=bool(a["step_scheduler_with_optimizer"]),
    )
