"""Shard a user's plain ``DataLoader`` over the dp ranks and move its batches to the device."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import DataLoader, DistributedSampler, RandomSampler


class DeviceLoader:
    """Iterate ``loader`` and move every tensor in each batch to ``device``."""

    def __init__(self, loader: DataLoader, device: torch.device):
        self.loader, self.device = loader, device

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self):
        for batch in self.loader:
            yield _to(batch, self.device)

    def set_epoch(self, epoch: int) -> None:
        sampler = getattr(self.loader, "sampler", None)
        if hasattr(sampler, "set_epoch"):
            sampler.set_epoch(epoch)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.loader, name)


def _to(obj, device):
    if isinstance(obj, torch.Tensor):
        return obj.to(device, non_blocking=True)
    if isinstance(obj, dict):
        return {k: _to(v, device) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to(v, device) for v in obj)
    return obj


def shard_dataloader(
    loader: DataLoader,
    dp_rank: int,
    dp_size: int,
    device: torch.device | None,
    *,
    batch_size: int | None = None,
    seed: int = 0,
    seeded: bool = False,
):
    """A loader giving dp rank ``dp_rank`` its own 1/``dp_size`` of the samples (tp/cp peers share a
    dp rank and so see the same samples), interleaved: rank r gets samples r, r+dp, ... of the
    (seeded, same on every rank) sampler order. ``batch_size`` overrides the per-rank batch size
    (e.g. the loader's divided by dp_size: its batches are then the global batches). ``seeded``: a
    shuffling loader draws that seeded order on one dp rank too (Accelerate's
    ``use_seedable_sampler``: the order of ``torch.randperm(n)`` from ``seed + epoch``, whatever the
    dp size). Loaders that already shard, or use a custom batch sampler, are only moved to the device
    (``device=None``: batches stay where the loader puts them)."""
    shards = dp_size > 1 or (seeded and isinstance(loader.sampler, RandomSampler))
    if shards and not isinstance(loader.sampler, DistributedSampler) and loader.batch_size is not None:
        sampler = DistributedSampler(
            loader.dataset,
            num_replicas=dp_size,
            rank=dp_rank,
            seed=seed,
            shuffle=isinstance(loader.sampler, RandomSampler),
            drop_last=loader.drop_last,
        )
        loader = DataLoader(
            loader.dataset,
            batch_size=batch_size or loader.batch_size,
            sampler=sampler,
            collate_fn=loader.collate_fn,
            num_workers=loader.num_workers,
            pin_memory=loader.pin_memory,
            drop_last=loader.drop_last,
        )
    return DeviceLoader(loader, device) if device is not None else loader
