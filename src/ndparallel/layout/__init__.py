"""The layout: the parallel degrees (``ParallelismConfig``: pp, dp_replicate, dp_shard, cp, tp, and ep
carved out of them) and the ``DeviceMesh`` built from them."""

from ndparallel.layout.config import ENV_VARS, ParallelismConfig, ParallelismConfigError
from ndparallel.layout.dim_handlers import (
    TorchContextParallelConfig,
    TorchTensorParallelConfig,
)
from ndparallel.layout.dims import FLATTENED_DIMS, MESH_DIM_NAMES

__all__ = [
    "ENV_VARS",
    "FLATTENED_DIMS",
    "MESH_DIM_NAMES",
    "ParallelismConfig",
    "ParallelismConfigError",
    "TorchContextParallelConfig",
    "TorchTensorParallelConfig",
]
