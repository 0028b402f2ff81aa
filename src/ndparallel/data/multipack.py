"""Axolotl's multipack order (``sample_packing_order: multipack``): which samples share a row and
which rows a step trains, as Axolotl 0.19's ``MultipackBatchSampler`` under transformers' Trainer
(read to learn the rule; its code needs numba, this is numpy and ``bins.first_fit``).

* Rows: the samples in the order of a draw, packed first fit into rows of ``sequence_len`` tokens,
  at most ``sample_packing_bin_size`` samples a row, ``sample_packing_group_size`` samples at a
  time (next fit with ``sample_packing_sequentially``); rows in the order they were opened.
* The draw: on one dp rank epoch ``e``'s is unpacked samples' (``loader.epoch_permutation``, seed +
  e: the Trainer's ``set_epoch`` reaches the sampler). On several, Axolotl packs once, from its
  sampler's ``c + 1``-th draw off the global generator seeded with ``seed`` (``c`` = 4 counting
  draws, 1 from 4 ranks on), and trains those rows every epoch: Accelerate's shard of the sampler
  hides ``set_epoch`` from it. Both are reproduced.
* Steps: ``micro_batch_size`` rows a micro-batch; micro-batch ``j`` goes to dp rank ``j % dp_size``
  (Accelerate's shards), an epoch is the fewest micro-batches of the ``c`` counting draws, whole
  rounds of the ranks (a shorter epoch starts its rows again). That is ``PackedLoader``'s split
  with the rows in opening order, so ``MultipackLoader`` only changes where rows come from.

The samples stay one per row (``rows.RowStore``); a packed row is laid out from them when a
micro-batch is read, as ``rows.write_rows`` lays one out (``position_ids`` restart at each sample,
the label across a sample start is -100)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from .bins import first_fit, next_fit, rows_of
from .loader import PackedLoader, epoch_permutation
from .packing import IGNORE_INDEX
from .rows import COLUMNS, RowStore


def multipack_rows(
    lengths: np.ndarray,
    draw: np.ndarray,
    capacity: int,
    *,
    bin_size: int = 200,
    group_size: int = 100_000,
    sequential: bool = False,
) -> tuple[np.ndarray, np.ndarray]:
    """``(members, starts)``: row ``r`` holds samples ``members[starts[r]:starts[r+1]]`` (indices
    into ``lengths``, in the order they went in), rows in the order they were opened, when the
    samples come in the order ``draw``."""
    drawn = np.asarray(lengths, np.int64)[draw]
    if sequential:
        row_of = next_fit(drawn, capacity)
    else:
        row_of = np.empty(len(drawn), np.int64)
        opened = 0
        for g in range(0, len(drawn), group_size):
            rows = first_fit(drawn[g : g + group_size], capacity, max_per_row=bin_size)
            row_of[g : g + group_size] = rows + opened
            opened += int(rows.max()) + 1
    order, starts = rows_of(row_of)
    return np.asarray(draw)[order], starts


def axolotl_draws(n: int, seed: int, count: int) -> list[np.ndarray]:
    """The ``count + 1`` orders Axolotl's sampler (transformers' ``RandomSampler``, no generator
    of its own) draws while counting its batches: each from a seed taken off the global generator,
    which the Trainer seeded with ``seed``."""
    source = torch.Generator().manual_seed(seed)
    seeds = [int(torch.empty((), dtype=torch.int64).random_(generator=source)) for _ in range(count + 1)]
    return [torch.randperm(n, generator=torch.Generator().manual_seed(s)).numpy() for s in seeds]


class MultipackRows:
    """The packed rows of every epoch over a store of one sample per row, for ``world`` dp ranks.
    A row is named ``epoch * len(samples) + r`` (row ``r`` of that epoch's packing), so the
    loader's row indices stay integers; ``[idx]`` lays rows out as ``RowStore[idx]`` does."""

    def __init__(
        self,
        samples: RowStore,
        pad_id: int,
        *,
        seed: int,
        world: int = 1,
        shuffle: bool = True,
        bin_size: int = 200,
        group_size: int = 100_000,
        sequential: bool = False,
    ):
        self.samples, self.pad_id, self.seed, self.world, self.shuffle = samples, pad_id, seed, world, shuffle
        self.options = {"bin_size": bin_size, "group_size": group_size, "sequential": sequential}
        self.n = len(samples)
        self.width = samples.shape[1]
        self.sample_lengths = samples.lengths(np.arange(self.n)).astype(np.int64)
        draws = axolotl_draws(self.n, seed, 1 if world >= 4 else 4) if shuffle else [np.arange(self.n)] * 2
        self.counting = [self.pack(d) for d in draws[1:]]  # the last is the rows of every epoch on > 1 rank
        self._packed: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def pack(self, draw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return multipack_rows(self.sample_lengths, draw, self.width, **self.options)

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.n, self.width))

    @property
    def ndim(self) -> int:
        return 2

    def __len__(self) -> int:
        return self.n

    def packing(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """``(members, starts)`` of ``epoch``'s rows (the last two epochs' are kept)."""
        if self.world > 1 or not self.shuffle:
            return self.counting[-1]
        if epoch not in self._packed:
            if len(self._packed) >= 2:
                self._packed.pop(min(self._packed))
            self._packed[epoch] = self.pack(epoch_permutation(self.n, self.seed, epoch).numpy())
        return self._packed[epoch]

    def num_rows(self, epoch: int) -> int:
        return len(self.packing(epoch)[1]) - 1

    def members(self, row: int) -> np.ndarray:
        """The samples of row ``row`` (``epoch * n + r``), in their order in it."""
        members, starts = self.packing(row // self.n)
        r = row % self.n
        return members[starts[r] : starts[r + 1]]

    def lengths(self, index) -> np.ndarray:
        rows = np.asarray(index).reshape(-1).tolist()
        return np.array([int(self.sample_lengths[self.members(r)].sum()) for r in rows], np.int64)

    def __getitem__(self, index) -> dict[str, torch.Tensor]:
        rows = np.asarray(index).reshape(-1).tolist()
        out = {c: np.empty((len(rows), self.width), np.int64) for c in COLUMNS}
        ramp = np.arange(2 * self.width)
        for i, row in enumerate(rows):
            members = self.members(row)
            parts = self.samples[members]
            n = self.sample_lengths[members]
            real = np.arange(self.width)[None, :] < n[:, None]
            for c in COLUMNS:
                values = parts[c].numpy()[real]
                out[c][i, : len(values)] = values
            used = int(n.sum())
            out["input_ids"][i, used:] = self.pad_id
            out["shift_labels"][i, used:] = IGNORE_INDEX
            last = int(out["position_ids"][i, used - 1]) + 1
            out["position_ids"][i, used:] = ramp[last : last + self.width - used]
        return {c: torch.from_numpy(v) for c, v in out.items()}


class MultipackLoader(PackedLoader):
    """``PackedLoader`` over ``MultipackRows`` (made for ``dp_size`` ranks): epoch ``e``'s rows in
    the order they were opened, ``len`` Axolotl's count of its batches over the ranks."""

    def __init__(self, rows: MultipackRows, micro_batch_size: int, **kwargs: Any):
        super().__init__(rows, micro_batch_size, seed=rows.seed, shuffle=rows.shuffle, **kwargs)
        if rows.world != self.dp_size:
            raise ValueError(f"MultipackRows are for {rows.world} dp ranks, the loader for {self.dp_size}")
        batches = min(len(starts) - 1 for _, starts in rows.counting) // micro_batch_size
        self.steps_per_epoch = batches // self.dp_size
        if self.steps_per_epoch == 0:
            raise ValueError(
                f"sample_packing_order: multipack packs {batches} micro-batches of {micro_batch_size} "
                f"rows, fewer than the {self.dp_size} data-parallel ranks; add data, lower "
                "micro_batch_size or the data-parallel size"
            )

    def _permutation(self, epoch: int) -> torch.Tensor:
        need = self.steps_per_epoch * self.global_micro_batch
        return epoch * self.blocks.n + torch.arange(need) % self.blocks.num_rows(epoch)

    def with_dp(self, dp_rank: int, dp_size: int) -> MultipackLoader:
        b = self.blocks
        rows = MultipackRows(b.samples, b.pad_id, seed=b.seed, world=dp_size, shuffle=b.shuffle, **b.options)
        other = MultipackLoader(
            rows,
            self.micro_batch_size,
            dp_rank=dp_rank,
            dp_size=dp_size,
            pad_to_multiple=self.pad_to_multiple,
            buckets=self.buckets,
        )
        other.load_state_dict(self.state_dict())
        return other
