"""The layout: the four parallel degrees (``ParallelismConfig``) and the ``DeviceMesh`` built from them."""

from ndparallel.layout.config import ENV_VARS, ParallelismConfig, ParallelismConfigError
from ndparallel.layout.dims import FLATTENED_DIMS, MESH_DIM_NAMES
from ndparallel.layout.handlers import (
    TorchContextParallelConfig,
    TorchTensorParallelConfig,
)

__all__ = [
    "ENV_VARS",
    "FLATTENED_DIMS",
    "MESH_DIM_NAMES",
    "ParallelismConfig",
    "ParallelismConfigError",
    "TorchContextParallelConfig",
    "TorchTensorParallelConfig",
]
