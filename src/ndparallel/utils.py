"""What scripts import from ``accelerate.utils``, under the same names, so they port by replacing
``accelerate`` with ``ndparallel`` in their imports: plugin / handler / configuration classes (mapped
onto ndparallel's options by the Accelerator), enums, cross-process helpers and ``set_seed``."""

from __future__ import annotations

import os
import random

from ndparallel.accelerator.accelerator_state import DistributedType, PrecisionType, RNGType
from ndparallel.accelerator.collectives import (
    broadcast,
    broadcast_object_list,
    gather,
    gather_object,
    pad_across_processes,
    recursively_apply,
    reduce,
)
from ndparallel.accelerator.handlers import (
    AutocastKwargs,
    DistributedDataParallelKwargs,
    GradScalerKwargs,
    InitProcessGroupKwargs,
    KwargsHandler,
    ProfileKwargs,
)
from ndparallel.accelerator.plugins import (
    DataLoaderConfiguration,
    FullyShardedDataParallelPlugin,
    GradientAccumulationPlugin,
    ProjectConfiguration,
    TorchDynamoPlugin,
    TorchTensorParallelPlugin,
)
from ndparallel.accelerator.tracking import GeneralTracker, LoggerType
from ndparallel.layout.config import ParallelismConfig
from ndparallel.layout.dim_handlers import (
    TorchContextParallelConfig,
    TorchTensorParallelConfig,
)


def set_seed(seed: int, device_specific: bool = False, deterministic: bool = False) -> None:
    """Seed ``random``, numpy, torch (CPU and every GPU). ``device_specific`` adds the process
    index (different streams per rank); ``deterministic`` turns on torch's deterministic algorithms."""
    import numpy as np
    import torch
    import torch.distributed as dist

    if device_specific:
        seed += dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)
    if deterministic:
        torch.use_deterministic_algorithms(True)


__all__ = [
    "AutocastKwargs",
    "DataLoaderConfiguration",
    "DistributedDataParallelKwargs",
    "DistributedType",
    "FullyShardedDataParallelPlugin",
    "GeneralTracker",
    "GradScalerKwargs",
    "GradientAccumulationPlugin",
    "InitProcessGroupKwargs",
    "KwargsHandler",
    "LoggerType",
    "ParallelismConfig",
    "PrecisionType",
    "ProfileKwargs",
    "ProjectConfiguration",
    "RNGType",
    "TorchContextParallelConfig",
    "TorchDynamoPlugin",
    "TorchTensorParallelConfig",
    "TorchTensorParallelPlugin",
    "broadcast",
    "broadcast_object_list",
    "gather",
    "gather_object",
    "pad_across_processes",
    "recursively_apply",
    "reduce",
    "set_seed",
]
