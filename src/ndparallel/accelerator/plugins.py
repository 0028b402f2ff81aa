"""Hugging Face Accelerate's plugin and configuration classes, under its names and defaults
(environment variables included, so an ``accelerate launch --config-file`` setting reaches the
script), mapped onto ndparallel's options. A setting ndparallel cannot honour raises ``ValueError``
naming the argument and what to use instead; none is silently dropped. Accelerate's own warnings
for options FSDP2 makes obsolete are kept as warnings."""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, replace
from typing import Any

import torch

from ndparallel.parallel.options import ActivationOptions, FSDPOptions
from ndparallel.techniques.technique_options import CompileOptions

_TRUE = ("1", "true", "yes", "y", "on")
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.bfloat16}
# FSDP1 sharding strategies (Accelerate's 1-based numbering) -> reshard_after_forward, or a refusal.
_SHARDING = {
    "FULL_SHARD": True,
    "SHARD_GRAD_OP": False,
    "NO_SHARD": None,
    "HYBRID_SHARD": None,
    "HYBRID_SHARD_ZERO2": None,
}


def env_flag(name: str, default: str = "false") -> bool:
    return os.environ.get(name, default).strip().lower() in _TRUE


def _unsupported(arg: str, value: Any, instead: str) -> ValueError:
    return ValueError(f"{arg}={value!r} is not supported by ndparallel: {instead}")


_USER = 4
"""``stacklevel`` of a warning in a ``_resolve_*`` step: the user's ``FullyShardedDataParallelPlugin(...)``
(the dataclass ``__init__``, ``__post_init__``, the step)."""


@dataclass
class FullyShardedDataParallelPlugin:
    """Accelerate's FSDP plugin; ndparallel runs FSDP2 (``fully_shard``) per decoder layer.

    Honoured: ``reshard_after_forward`` (or ``sharding_strategy`` FULL_SHARD / SHARD_GRAD_OP),
    ``cpu_offload``, ``activation_checkpointing``, ``mixed_precision_policy`` (param and reduce
    dtypes), ``auto_wrap_policy="transformer_based_wrap"`` with ``transformer_cls_names_to_wrap``,
    ``state_dict_type``, ``cpu_ram_efficient_loading`` (transformers loads the weights on rank 0
    only, ``prepare`` broadcasts them into each rank's shards; ``accelerator.load_model`` does
    better: each rank reads only its shards). ``auto_wrap_policy`` None/"no_wrap" still shards each decoder
    layer
    (same result, lower peak memory than one root unit). Unset fields read Accelerate's
    ``FSDP_*`` environment variables.
    """

    fsdp_version: int | None = None
    sharding_strategy: Any = None
    reshard_after_forward: Any = None
    backward_prefetch: Any = None
    mixed_precision_policy: Any = None
    auto_wrap_policy: Any = None
    cpu_offload: Any = None
    ignored_modules: Any = None
    state_dict_type: Any = None
    state_dict_config: Any = None
    optim_state_dict_config: Any = None
    limit_all_gathers: bool = True
    use_orig_params: bool | None = None
    param_init_fn: Any = None
    sync_module_states: bool | None = None
    forward_prefetch: bool | None = None
    activation_checkpointing: bool | None = None
    activation_checkpointing_offload: bool | None = None
    cpu_ram_efficient_loading: bool | None = None
    transformer_cls_names_to_wrap: list[str] | None = None
    min_num_params: int | None = None

    def __post_init__(self) -> None:
        env = os.environ
        if self.fsdp_version is None:
            self.fsdp_version = int(env.get("FSDP_VERSION", "2"))
        if int(self.fsdp_version) != 2:
            raise _unsupported(
                "fsdp_version", self.fsdp_version, "ndparallel shards with FSDP2; set fsdp_version=2"
            )
        self._resolve_sharding(env)
        self._resolve_wrapping(env)
        self._resolve_flags(env)
        self._resolve_precision()

    def _resolve_sharding(self, env) -> None:
        if self.sharding_strategy is not None:
            name = getattr(self.sharding_strategy, "name", str(self.sharding_strategy)).upper()
            if name.isdigit():
                name = list(_SHARDING)[int(name) - 1]
            if _SHARDING.get(name) is None:
                raise _unsupported(
                    "sharding_strategy",
                    name,
                    "FULL_SHARD or SHARD_GRAD_OP; for HSDP set "
                    "ParallelismConfig(dp_replicate_size=..., dp_shard_size=...), for plain "
                    "data parallelism dp_replicate_size alone",
                )
            warnings.warn(
                "sharding_strategy is deprecated in favor of reshard_after_forward",
                FutureWarning,
                stacklevel=_USER,
            )
            if self.reshard_after_forward is None:
                self.reshard_after_forward = _SHARDING[name]
        if self.reshard_after_forward is None:
            self.reshard_after_forward = env.get("FSDP_RESHARD_AFTER_FORWARD", "true")
        if isinstance(self.reshard_after_forward, str):
            self.reshard_after_forward = self.reshard_after_forward.strip().lower() in _TRUE
        if not isinstance(self.reshard_after_forward, bool):
            raise _unsupported("reshard_after_forward", self.reshard_after_forward, "use True or False")
        if self.backward_prefetch is None:
            self.backward_prefetch = env.get("FSDP_BACKWARD_PREFETCH")
        if self.backward_prefetch is not None and str(self.backward_prefetch).upper() != "NO_PREFETCH":
            warnings.warn(
                "backward_prefetch is not supported in FSDP2. Setting backward prefetch to None.",
                stacklevel=_USER,
            )
        self.backward_prefetch = None
        if self.forward_prefetch is None:
            self.forward_prefetch = env_flag("FSDP_FORWARD_PREFETCH") or None
        if self.forward_prefetch:
            raise _unsupported("forward_prefetch", True, "FSDP2 has no forward_prefetch; leave it unset")

    def _resolve_wrapping(self, env) -> None:
        policy = self.auto_wrap_policy
        if policy is None:
            policy = env.get("FSDP_AUTO_WRAP_POLICY", "NO_WRAP")
        if callable(policy):
            raise _unsupported(
                "auto_wrap_policy",
                policy,
                "use 'transformer_based_wrap' with transformer_cls_names_to_wrap=[...decoder layer class...]",
            )
        policy = str(policy).upper()
        if policy == "SIZE_BASED_WRAP":
            raise _unsupported(
                "auto_wrap_policy",
                "size_based_wrap",
                "use 'transformer_based_wrap' (ndparallel shards per decoder layer)",
            )
        if policy not in ("NO_WRAP", "TRANSFORMER_BASED_WRAP"):
            raise _unsupported("auto_wrap_policy", policy, "use 'transformer_based_wrap' or 'no_wrap'")
        self.auto_wrap_policy = policy.lower()
        if policy == "TRANSFORMER_BASED_WRAP" and self.transformer_cls_names_to_wrap is None:
            self.transformer_cls_names_to_wrap = env.get("FSDP_TRANSFORMER_CLS_TO_WRAP") or None
        if isinstance(self.transformer_cls_names_to_wrap, str):
            self.transformer_cls_names_to_wrap = self.transformer_cls_names_to_wrap.split(",")
        if self.min_num_params is not None:
            raise _unsupported(
                "min_num_params",
                self.min_num_params,
                "it belongs to size_based_wrap, which ndparallel does not offer; drop it",
            )

    def _resolve_flags(self, env) -> None:
        if self.cpu_offload is None:
            self.cpu_offload = env_flag("FSDP_OFFLOAD_PARAMS")
        if not isinstance(self.cpu_offload, bool):  # torch's CPUOffloadPolicy / OffloadPolicy
            self.cpu_offload = type(self.cpu_offload).__name__ == "CPUOffloadPolicy"
        if self.activation_checkpointing is None:
            self.activation_checkpointing = env_flag("FSDP_ACTIVATION_CHECKPOINTING")
        if self.activation_checkpointing_offload is None:
            self.activation_checkpointing_offload = env_flag("FSDP_ACTIVATION_CHECKPOINTING_OFFLOAD")
        if self.activation_checkpointing_offload:
            raise _unsupported(
                "activation_checkpointing_offload",
                True,
                "use activation_checkpointing=True (recomputation on the device) or cpu_offload=True",
            )
        if self.ignored_modules is None:
            self.ignored_modules = env.get("FSDP_IGNORED_MODULES") or None
        if self.ignored_modules is not None:
            raise _unsupported(
                "ignored_modules",
                self.ignored_modules,
                "every parameter is sharded; freeze modules with requires_grad_(False) instead",
            )
        if self.cpu_ram_efficient_loading is None:
            self.cpu_ram_efficient_loading = env_flag("FSDP_CPU_RAM_EFFICIENT_LOADING")
        for name in ("state_dict_config", "optim_state_dict_config", "param_init_fn"):
            if getattr(self, name) is not None:
                raise _unsupported(
                    name,
                    getattr(self, name),
                    "FSDP2 state dicts are configured by "
                    "ndparallel (DCP); meta-device init is accelerator.load_model",
                )
        if not self.limit_all_gathers:
            raise _unsupported("limit_all_gathers", False, "it is an FSDP1 setting; FSDP2 has none")
        for name in ("use_orig_params", "sync_module_states"):
            if getattr(self, name) is not None:
                warnings.warn(
                    f"{name} is obsolete in FSDP2 (always on / not needed); ignoring it.", stacklevel=_USER
                )
                setattr(self, name, None)
        if self.state_dict_type is None:
            self.state_dict_type = env.get("FSDP_STATE_DICT_TYPE", "FULL_STATE_DICT")
        self.state_dict_type = getattr(self.state_dict_type, "name", str(self.state_dict_type)).upper()
        if self.state_dict_type not in ("FULL_STATE_DICT", "SHARDED_STATE_DICT"):
            raise _unsupported(
                "state_dict_type", self.state_dict_type, "use SHARDED_STATE_DICT or FULL_STATE_DICT"
            )

    def _resolve_precision(self) -> None:
        policy = self.mixed_precision_policy
        self._param_dtype = self._reduce_dtype = None
        if policy is None:
            return
        if isinstance(policy, str):
            if policy not in _DTYPES:
                raise _unsupported("mixed_precision_policy", policy, f"use one of {sorted(_DTYPES)}")
            self._param_dtype = self._reduce_dtype = _DTYPES[policy]
            return
        get = policy.get if isinstance(policy, dict) else (lambda k, d=None: getattr(policy, k, d))
        if get("output_dtype") is not None or get("buffer_dtype") is not None:
            raise _unsupported(
                "mixed_precision_policy.output_dtype",
                get("output_dtype"),
                "outputs keep the compute dtype; leave output_dtype unset",
            )
        if get("cast_forward_inputs", True) is False:
            raise _unsupported("mixed_precision_policy.cast_forward_inputs", False, "inputs are always cast")
        self._param_dtype, self._reduce_dtype = get("param_dtype"), get("reduce_dtype")

    @property
    def param_dtype(self) -> torch.dtype | None:
        """Compute dtype set by ``mixed_precision_policy`` (None: from ``mixed_precision``)."""
        return self._param_dtype

    def to_options(self, base: FSDPOptions | None = None) -> FSDPOptions:
        """These settings as ``FSDPOptions`` (fields the plugin does not own kept from ``base``)."""
        names = self.transformer_cls_names_to_wrap
        return replace(
            base or FSDPOptions(),
            reshard_after_forward=self.reshard_after_forward,
            cpu_offload=self.cpu_offload,
            layer_classes=tuple(names) if names else (base.layer_classes if base else None),
            reduce_dtype=self._reduce_dtype,
        )

    def activation_options(self, base: ActivationOptions | None = None) -> ActivationOptions:
        """The plugin's ``activation_checkpointing`` as ``ActivationOptions`` (the rest from ``base``)."""
        return replace(
            base or ActivationOptions(), activation_checkpointing=bool(self.activation_checkpointing)
        )

    def set_mixed_precision(self, mixed_precision, buffer_autocast: bool = False, override: bool = False):
        """Accelerate's setter: the policy's dtypes from a precision name or dtype."""
        if override or self.mixed_precision_policy is None:
            self.mixed_precision_policy = mixed_precision
            self._resolve_precision()


@dataclass
class TorchTensorParallelPlugin:
    """Accelerate's deprecated TP plugin: ``tp_size`` becomes ``ParallelismConfig(tp_size=...)``."""

    tp_size: int = 1
    torch_device_mesh: Any = None

    def __post_init__(self) -> None:
        if self.torch_device_mesh is not None:
            raise _unsupported(
                "TorchTensorParallelPlugin.torch_device_mesh",
                "a mesh",
                "the Accelerator "
                "builds the mesh from ParallelismConfig(tp_size=...); read accelerator.torch_device_mesh",
            )


@dataclass
class TorchDynamoPlugin:
    """``torch.compile`` settings, honoured as ndparallel's regional compilation (each decoder
    layer compiled, torchtitan style; ``CompileOptions``) rather than one whole-model graph: the
    same speed-up, and it composes with FSDP/TP hooks and the CP attention. Backend "no" (or
    ``disable``) compiles nothing; None reads ``ACCELERATE_DYNAMO_BACKEND``, as Accelerate does.
    ``mode``/``dynamic``/``options`` other than their defaults are refused."""

    backend: Any = None
    mode: str | None = None
    fullgraph: bool | None = None
    dynamic: bool | None = None
    options: Any = None
    disable: bool = False
    use_regional_compilation: bool | None = None

    def __post_init__(self) -> None:
        if self.backend is None:
            self.backend = os.environ.get("ACCELERATE_DYNAMO_BACKEND", "no")
        self.backend = str(getattr(self.backend, "value", self.backend)).lower()
        for name in ("mode", "dynamic", "options"):
            if getattr(self, name) not in (None, "default") and self.enabled:
                raise _unsupported(
                    f"dynamo {name}",
                    getattr(self, name),
                    "ndparallel compiles each decoder layer with the backend's defaults",
                )

    @property
    def enabled(self) -> bool:
        return self.backend != "no" and not self.disable

    def compile_options(self):

        return CompileOptions(
            enabled=self.enabled,
            backend=self.backend if self.enabled else "inductor",
            fullgraph=bool(self.fullgraph),
        )


@dataclass
class DataLoaderConfiguration:
    """How ``prepare`` shards a ``DataLoader`` over the data-parallel ranks (tp/cp peers share
    batches). ``split_batches``: the loader's batch is the global batch, cut into dp parts."""

    split_batches: bool = False
    dispatch_batches: bool | None = None
    even_batches: bool = True
    use_seedable_sampler: bool = False
    data_seed: int | None = None
    non_blocking: bool = False
    use_stateful_dataloader: bool = False

    def __post_init__(self) -> None:
        if self.dispatch_batches:
            raise _unsupported(
                "dispatch_batches",
                True,
                "each data-parallel rank reads its own share; leave dispatch_batches unset",
            )
        if not self.even_batches:
            raise _unsupported(
                "even_batches",
                False,
                "ranks always get the same number of batches "
                "(the sampler pads, or drop_last=True drops the remainder)",
            )
        if self.use_stateful_dataloader:
            raise _unsupported(
                "use_stateful_dataloader",
                True,
                "save the data position yourself (register_for_checkpointing) or use `ndparallel train`",
            )


@dataclass
class ProjectConfiguration:
    """Where trackers log and ``save_state()`` (no directory given) saves."""

    project_dir: str | None = None
    logging_dir: str | None = None
    automatic_checkpoint_naming: bool = False
    total_limit: int | None = None
    iteration: int = 0
    save_on_each_node: bool = False

    def __post_init__(self) -> None:
        self.set_directories(self.project_dir)

    def set_directories(self, project_dir: str | None = None) -> None:
        self.project_dir = project_dir
        if self.logging_dir is None:
            self.logging_dir = project_dir


@dataclass
class GradientAccumulationPlugin:
    num_steps: int | None = None
    adjust_scheduler: bool = True
    sync_with_dataloader: bool = True
    sync_each_batch: bool = False

    def __post_init__(self) -> None:
        if self.num_steps is None:
            self.num_steps = int(os.environ.get("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", "1"))
        if int(self.num_steps) < 1:
            raise ValueError(f"num_steps (gradient_accumulation_steps) must be >= 1, got {self.num_steps}")


__all__ = [
    "DataLoaderConfiguration",
    "FullyShardedDataParallelPlugin",
    "GradientAccumulationPlugin",
    "ProjectConfiguration",
    "TorchDynamoPlugin",
    "TorchTensorParallelPlugin",
    "env_flag",
]
