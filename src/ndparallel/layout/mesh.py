"""Build the 5-D ``DeviceMesh`` (pp, dp_replicate, dp_shard, cp, tp) and its flattened views; read rank
coordinates and groups."""

from __future__ import annotations

import datetime
import inspect
import os
import warnings
from collections.abc import Mapping

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from ndparallel.layout.dims import (
    DEVICE_MESH_DIM_NAMES,
    EXPERT_DIM_NAMES,
    FLATTENED_DIMS,
    MESH_DIM_NAMES,
    ParallelDims,
)


def is_fake_world() -> bool:
    """Is the default process group torch's fake backend (``ndparallel simulate``: one real rank of
    a larger world, collectives returning at once without data)?"""
    import torch.distributed as dist

    return dist.is_initialized() and str(dist.get_backend()) == "fake"


def group_options(device_type: str, timeout: datetime.timedelta):
    """Backend options that carry ``timeout`` to a new process group of ``device_type``.

    ``init_device_mesh`` and ``_flatten`` create every sub-group with torch's default timeout
    (30 min, 10 min for NCCL) unless given options holding one: without this a rank stuck in a
    tp/cp/dp_shard collective would wait that long whatever the job's collective timeout is."""
    import torch.distributed as dist

    if device_type == "cuda":
        opts = dist.ProcessGroupNCCL.Options()  # on a mixed cpu:gloo,cuda:nccl group, gloo takes
    else:  # the same timeout from these options
        opts = dist.ProcessGroupGloo._Options()
    opts._timeout = timeout
    return opts


def flatten_dims(mesh: DeviceMesh, dims: tuple[str, ...], name: str, options=None) -> DeviceMesh:
    """Flatten ``dims`` of ``mesh`` into one dim called ``name`` (its group created with
    ``options`` when given, see ``group_options``).

    torch 2.13 has no public flatten API; this is the only place that touches the private
    ``DeviceMesh._flatten`` so a future public API replaces one line.
    """
    if options is None:
        return mesh[dims]._flatten(name)
    return mesh[dims]._flatten(name, backend_override=(None, options))


def ensure_default_group(device_type: str) -> None:
    """Start the default process group if none exists, as torch's ``init_device_mesh`` (and
    Accelerate) do: under ``torchrun`` from its env vars, else a one-rank group. The timeout is
    ``NDPARALLEL_TIMEOUT`` seconds (default 600), so a dead peer fails the job instead of hanging.
    (``ndparallel.runtime.distributed.init_distributed`` is the full start-up the Accelerator uses:
    device choice and restarts under the elastic agent.)"""
    import torch.distributed as dist

    if dist.is_initialized():
        return
    timeout = datetime.timedelta(seconds=float(os.environ.get("NDPARALLEL_TIMEOUT", "600")))
    backend = "gloo" if device_type == "cpu" else None  # None: torch's cpu:gloo,cuda:nccl
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        dist.init_process_group(backend=backend, timeout=timeout)
    else:
        dist.init_process_group(
            backend=backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout
        )


def build_mesh(
    device_type: str, sizes: Mapping[str, int], timeout: datetime.timedelta | None = None
) -> DeviceMesh:
    """Mesh (pp, dp_replicate, dp_shard, cp, tp) over the default group, plus flattened views
    (inside each pipeline stage). ``sizes`` without "pp": one stage. With ``timeout`` every group
    of the mesh (base dims and flattened views) gets it."""
    sizes = {"pp": 1, **sizes}
    shape = tuple(sizes[d] for d in DEVICE_MESH_DIM_NAMES)
    # a fake group takes no backend options (and nothing can time out in it)
    options = group_options(device_type, timeout) if timeout is not None and not is_fake_world() else None
    kwargs = {}
    if options is not None:
        kwargs["backend_override"] = {d: (None, options) for d in DEVICE_MESH_DIM_NAMES}
    mesh = init_device_mesh(device_type, shape, mesh_dim_names=DEVICE_MESH_DIM_NAMES, **kwargs)
    for name, dims in FLATTENED_DIMS.items():
        flatten_dims(mesh, dims, name, options if _flatten_takes_options() else None)
    return mesh


def build_expert_mesh(
    mesh: DeviceMesh, dims: ParallelDims, timeout: datetime.timedelta | None = None
) -> DeviceMesh:
    """The expert mesh ``(dp_replicate, efsdp, ep)`` over the same ranks as ``mesh`` (torchtitan's
    "sparse" mesh): the dense dims flattened and unflattened again, ``ep`` innermost, so its
    dims and the dense ones share one root (FSDP2 composes an ``ep``-sharded DTensor with its
    ``efsdp`` mesh only then). Creates the ``efsdp`` and ``ep`` process groups: every rank calls it.
    ``DeviceMesh._unflatten`` (torch >= 2.10) is private: this is the one place that calls it."""
    if not hasattr(DeviceMesh, "_unflatten"):
        import torch

        raise RuntimeError(
            f"expert parallel needs DeviceMesh._unflatten (torch >= 2.10); torch "
            f"{torch.__version__} has none: upgrade torch or set expert_parallel_size: 1"
        )
    real = timeout is not None and not is_fake_world()  # a fake group takes no backend options
    options = group_options(mesh.device_type, timeout) if real else None
    world = flatten_dims(mesh, MESH_DIM_NAMES, "world", options if _flatten_takes_options() else None)
    sizes = (dims.dp_replicate, dims.efsdp, dims.ep)
    kwargs = {}
    if options is not None:
        kwargs["backend_override"] = {d: (None, options) for d in EXPERT_DIM_NAMES}
    return world._unflatten(0, sizes, EXPERT_DIM_NAMES, **kwargs)


def _flatten_takes_options() -> bool:
    return "backend_override" in inspect.signature(DeviceMesh._flatten).parameters


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
    return {dim: submesh(mesh, dim).get_local_rank() for dim in (*DEVICE_MESH_DIM_NAMES, *FLATTENED_DIMS)}
