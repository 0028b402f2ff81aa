"""Build the 4-D ``DeviceMesh`` and its flattened views; read rank coordinates and groups."""

from __future__ import annotations

import warnings
from typing import Mapping

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from ndparallel.layout.dims import FLATTENED_DIMS, MESH_DIM_NAMES


def flatten_dims(mesh: DeviceMesh, dims: tuple[str, ...], name: str) -> DeviceMesh:
    """Flatten ``dims`` of ``mesh`` into one dim called ``name``.

    torch 2.13 has no public flatten API; this is the only place that touches the private
    ``DeviceMesh._flatten`` so a future public API replaces one line.
    """
    return mesh[dims]._flatten(name)


def build_mesh(device_type: str, sizes: Mapping[str, int]) -> DeviceMesh:
    """Mesh (dp_replicate, dp_shard, cp, tp) over the default group, plus flattened views."""
    shape = tuple(sizes[d] for d in MESH_DIM_NAMES)
    mesh = init_device_mesh(device_type, shape, mesh_dim_names=MESH_DIM_NAMES)
    for name, dims in FLATTENED_DIMS.items():
        flatten_dims(mesh, dims, name)
    return mesh


def submesh(mesh: DeviceMesh, *dims: str) -> DeviceMesh:
    """``mesh[dims]`` for base or flattened dim names (one or several, outermost first)."""
    with warnings.catch_warnings():
        # torch >= 2.11 warns that slicing a flattened dim from the root will be deprecated; the
        # flattened meshes are only reachable that way until a public flatten API exists.
        warnings.filterwarnings("ignore", message="Slicing a flattened dim")
        return mesh[dims[0]] if len(dims) == 1 else mesh[dims]


def process_group(mesh_or_group):
    """The ``ProcessGroup`` of a 1-D ``DeviceMesh``; a ``ProcessGroup`` is returned as is."""
    return mesh_or_group.get_group() if hasattr(mesh_or_group, "get_group") else mesh_or_group


def group_ranks(mesh: DeviceMesh, dim: str) -> list[int]:
    """Global ranks in this rank's group along ``dim`` (base or flattened)."""
    import torch.distributed as dist

    return dist.get_process_group_ranks(submesh(mesh, dim).get_group())


def coordinates(mesh: DeviceMesh) -> dict[str, int]:
    """This rank's index along every base and flattened dim."""
    return {dim: submesh(mesh, dim).get_local_rank() for dim in (*MESH_DIM_NAMES, *FLATTENED_DIMS)}
