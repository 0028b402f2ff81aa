"""Where a run goes, known before any rank starts: how many ranks (the product of its degrees,
``--nproc-per-node``, the launcher's ``WORLD_SIZE``, or every local GPU for a degree of -1) and on
which device type."""

from __future__ import annotations

import os

from ndparallel.config import ConfigError, TrainConfig


def world_size_for(cfg: TrainConfig, nproc: int | None) -> int:
    if nproc is not None and nproc < 1:
        raise ConfigError(f"--nproc-per-node must be >= 1, got {nproc}")
    if "WORLD_SIZE" in os.environ:
        return int(os.environ["WORLD_SIZE"])
    sizes = [
        cfg.dp_replicate_size,
        cfg.dp_shard_size,
        cfg.tensor_parallel_size,
        cfg.context_parallel_size,
        cfg.pipeline_parallel_size,
    ]
    if -1 in sizes:
        return nproc or local_devices(cfg)
    total = 1
    for s in sizes:
        total *= s
    if nproc and nproc != total:
        raise ConfigError(f"--nproc-per-node {nproc} but the layout needs {total} ranks")
    return total


def local_devices(cfg: TrainConfig) -> int:
    """Ranks a degree of -1 fills on this machine without --nproc-per-node: every CUDA GPU (as
    Axolotl's launch uses them all); 1 on CPU."""
    import torch

    return torch.cuda.device_count() if cfg.device != "cpu" and torch.cuda.is_available() else 1


def run_device(cfg: TrainConfig) -> str:
    """The ranks' device type: ``device``, or with ``auto`` cuda where a GPU is visible, else cpu."""
    import torch

    return cfg.device if cfg.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
