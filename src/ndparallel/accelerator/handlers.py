"""Accelerate's ``kwargs_handlers`` classes. Each one ndparallel can honour is mapped (process-group
timeout, autocast, profiler); options of ones it cannot (DDP bucket tuning: data parallelism here
is FSDP2's replicate dim, not DDP; fp16 loss scaling) are accepted at their defaults and refused
otherwise, naming the argument."""

from __future__ import annotations

import copy
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from ndparallel.engine.loss_scale import LossScaler


class KwargsHandler:
    """Base of the handlers: ``to_kwargs()`` gives the fields that differ from their defaults."""

    def to_dict(self) -> dict:
        return copy.deepcopy(self.__dict__)

    def to_kwargs(self) -> dict:
        default = self.__class__().to_dict()
        return {k: v for k, v in self.to_dict().items() if default.get(k) != v}


@dataclass
class DistributedDataParallelKwargs(KwargsHandler):
    """DDP options. Data parallelism here is FSDP2 on the replicate dim, so none applies: only the
    defaults are accepted (``find_unused_parameters``, which DDP needs for unused parameters, is
    never needed: FSDP2 reduces every gradient)."""

    dim: int = 0
    broadcast_buffers: bool = True
    bucket_cap_mb: int = 25
    find_unused_parameters: bool = False
    check_reduction: bool = False
    gradient_as_bucket_view: bool = False
    static_graph: bool = False
    comm_hook: Any = None
    comm_wrapper: Any = None
    comm_state_option: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name, value in self.to_kwargs().items():
            if name == "find_unused_parameters":
                continue  # harmless: FSDP2 handles parameters without gradient
            if name in ("comm_hook", "comm_wrapper") and str(getattr(value, "value", value)).lower() == "no":
                continue
            raise ValueError(
                f"DistributedDataParallelKwargs({name}={value!r}) is not supported: ndparallel's data "
                "parallelism is FSDP2 (replicate dim), not DDP; drop the argument"
            )


@dataclass
class InitProcessGroupKwargs(KwargsHandler):
    """``timeout`` becomes the collective timeout of every group; ``backend`` must be the one
    ndparallel picks (nccl on GPUs, gloo on CPU); ``init_method`` is the launcher's env://."""

    backend: str | None = "nccl"
    init_method: str | None = None
    timeout: timedelta | None = None

    def __post_init__(self) -> None:
        if self.backend not in (None, "nccl", "gloo", "cpu:gloo,cuda:nccl"):
            raise ValueError(
                f"InitProcessGroupKwargs(backend={self.backend!r}) is not supported: "
                "ndparallel uses nccl for GPUs (with gloo beside it) and gloo on CPU"
            )
        if self.init_method is not None:
            raise ValueError(
                "InitProcessGroupKwargs(init_method=...) is not supported: launch with "
                "torchrun / ndparallel launch (env:// rendezvous)"
            )

    @property
    def timeout_s(self) -> float | None:
        return self.timeout.total_seconds() if self.timeout is not None else None


@dataclass
class GradScalerKwargs(KwargsHandler):
    """fp16 loss-scaling options (``mixed_precision="fp16"``): the ``engine.LossScaler`` the
    prepared optimizers use (its overflow decision is global: the same on every rank)."""

    init_scale: float = 65536.0
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    enabled: bool = True

    def build(self):
        """The ``LossScaler`` (None when not ``enabled``)."""

        if not self.enabled:
            return None
        return LossScaler(self.init_scale, self.growth_factor, self.backoff_factor, self.growth_interval)


@dataclass
class AutocastKwargs(KwargsHandler):
    """Arguments of ``torch.autocast`` used by ``Accelerator.autocast``."""

    enabled: bool = True
    cache_enabled: bool | None = None


@dataclass
class ProfileKwargs(KwargsHandler):
    """``torch.profiler.profile`` settings for ``Accelerator.profile``."""

    activities: list[str] | None = None
    schedule_option: dict[str, int] | None = None
    on_trace_ready: Callable | None = None
    record_shapes: bool = False
    profile_memory: bool = False
    with_stack: bool = False
    with_flops: bool = False
    with_modules: bool = False
    output_trace_dir: str | None = None

    def build(self):
        import torch.profiler as tp

        names = {"cpu": tp.ProfilerActivity.CPU, "cuda": tp.ProfilerActivity.CUDA}
        activities = [names[a] for a in self.activities] if self.activities else None
        schedule = tp.schedule(**self.schedule_option) if self.schedule_option else None
        return tp.profile(
            activities=activities,
            schedule=schedule,
            on_trace_ready=self.on_trace_ready,
            record_shapes=self.record_shapes,
            profile_memory=self.profile_memory,
            with_stack=self.with_stack,
            with_flops=self.with_flops,
            with_modules=self.with_modules,
        )

    def trace_path(self, process_index: int) -> str | None:
        if not self.output_trace_dir:
            return None
        os.makedirs(self.output_trace_dir, exist_ok=True)
        return os.path.join(self.output_trace_dir, f"profile_{process_index}.json")


HANDLER_ATTRS = {
    DistributedDataParallelKwargs: "ddp_handler",
    InitProcessGroupKwargs: "init_handler",
    AutocastKwargs: "autocast_handler",
    ProfileKwargs: "profile_handler",
    GradScalerKwargs: "scaler_handler",
}


def sort_handlers(handlers) -> dict[str, KwargsHandler]:
    """``kwargs_handlers`` list -> {attribute: handler}; one of each class, known classes only."""
    out: dict[str, KwargsHandler] = {}
    for h in handlers or ():
        attr = HANDLER_ATTRS.get(type(h))
        if attr is None:
            raise ValueError(
                f"kwargs_handlers: {type(h).__name__} is not supported by ndparallel; supported: "
                f"{', '.join(c.__name__ for c in HANDLER_ATTRS)} (FP8 recipes: no fp8 training here)"
            )
        if attr in out:
            raise ValueError(f"You can only pass one {type(h).__name__} in `kwargs_handlers`.")
        out[attr] = h
    return out


__all__ = [c.__name__ for c in HANDLER_ATTRS] + ["KwargsHandler", "sort_handlers"]
