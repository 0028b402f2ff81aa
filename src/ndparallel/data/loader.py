"""Deterministic, data-parallel-sharded loading of packed blocks.

Every epoch, all ranks compute the same permutation of the blocks (a ``torch.Generator`` seeded
with ``seed + epoch``, as transformers' ``Trainer`` draws its samples). The stream of *global
micro-batches* takes ``dp_size * B`` blocks at a time from it (the remainder of an epoch is
dropped, so all ranks take the same number of steps); dp rank ``r`` gets rows ``[r*B, (r+1)*B)``
of each. So the dp ranks together see exactly what a 1-rank run with micro-batch ``dp_size * B``
sees, row for row (cut to one width there, to each rank's own here) — the project's equivalence
tests rely on it. Optimizer step ``t`` with ``grad_accum`` micro-batches uses global micro-batches
``t*grad_accum ... (t+1)*grad_accum - 1`` (which may cross an epoch boundary).
Ranks in one tp x cp group pass the same ``dp_rank`` and so get the same rows.

The rows are concatenated blocks ``[N, S+1]`` (``make_batch`` turns them into a batch) or a
``rows.RowStore`` of whole samples (already batch columns). For the latter, ``pad_to_multiple``
(``pad_to_sequence_len: false``) cuts each micro-batch after its longest row, rounded up to that
multiple (which the layout needs: 2·cp for CP, tp for sequence parallel) and, given ``buckets``, to
the next of those widths (``widths.py``): only padding is cut.

``token_counts`` says, without reading a token, how many tokens of a global micro-batch are real
and how many the ranks compute (real + padding): throughput counts the former.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from .packing import IGNORE_INDEX
from .widths import cut_width

Batch = dict[str, torch.Tensor]


def epoch_permutation(num_blocks: int, seed: int, epoch: int, shuffle: bool = True) -> torch.Tensor:
    """The order of blocks in ``epoch``; identical on every rank. The draw of transformers'
    ``Trainer`` (hence Axolotl's unpacked trainer): Accelerate's ``SeedableRandomSampler``, a
    ``torch.randperm`` from a generator seeded with ``seed + epoch``."""
    if not shuffle:
        return torch.arange(num_blocks)
    return torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed + epoch))


def make_batch(rows: torch.Tensor) -> Batch:
    """Blocks ``[B, S+1]`` -> ``input_ids``, ``shift_labels`` (-100 = ignored), ``position_ids``, all
    ``[B, S]``.

    Labels are already shifted: pass them to the loss as ``shift_labels``, never shift again.
    Padding (``IGNORE_INDEX`` in a block) becomes token 0 in ``input_ids`` and -100 in labels.
    """
    rows = rows.long()
    b, s = rows.shape[0], rows.shape[1] - 1
    return {
        "input_ids": rows[:, :-1].clamp(min=0),
        "shift_labels": rows[:, 1:].masked_fill(rows[:, 1:] < 0, IGNORE_INDEX),
        "position_ids": torch.arange(s).unsqueeze(0).expand(b, s).clone(),
    }


class PackedLoader:
    """Iterates this dp rank's micro-batches; one ``for`` loop over it is (the rest of) one epoch.

    ``len(loader)`` is the number of micro-batches per epoch (same on every rank). The state
    (``epoch``, ``position`` = micro-batches already yielded in the epoch) is updated as batches
    are yielded, so ``state_dict()`` taken after training on a batch resumes at the next one.
    """

    def __init__(
        self,
        blocks: torch.Tensor,
        micro_batch_size: int,
        *,
        dp_rank: int = 0,
        dp_size: int = 1,
        seed: int = 0,
        shuffle: bool = True,
        pad_to_multiple: int | None = None,
        buckets: tuple[int, ...] | None = None,
    ):
        if blocks.ndim != 2 or blocks.shape[1] < 2:
            raise ValueError(
                f"blocks must be a [num_blocks, sequence_len + 1] tensor, got shape {tuple(blocks.shape)}"
            )
        if micro_batch_size < 1 or dp_size < 1 or not 0 <= dp_rank < dp_size:
            raise ValueError(
                f"need micro_batch_size >= 1 and 0 <= dp_rank < dp_size, got "
                f"micro_batch_size={micro_batch_size}, dp_rank={dp_rank}, dp_size={dp_size}"
            )
        self.blocks = blocks
        self.micro_batch_size = micro_batch_size
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.seed, self.shuffle = seed, shuffle
        self.pad_to_multiple, self.buckets = pad_to_multiple, buckets
        self.global_micro_batch = dp_size * micro_batch_size
        self.steps_per_epoch = blocks.shape[0] // self.global_micro_batch
        if self.steps_per_epoch == 0:
            raise ValueError(
                f"only {blocks.shape[0]} blocks, fewer than dp_size * micro_batch_size = "
                f"{self.global_micro_batch}; add data, lower sequence_len or micro_batch_size"
            )
        self.epoch = 0
        self.position = 0
        self._perm_cache: tuple[int, torch.Tensor] | None = None

    def __len__(self) -> int:
        return self.steps_per_epoch

    def __iter__(self) -> Iterator[Batch]:
        if self.position >= self.steps_per_epoch:
            self.epoch, self.position = self.epoch + 1, 0
        while self.position < self.steps_per_epoch:
            batch = self.micro_batch(self.epoch * self.steps_per_epoch + self.position)
            self.position += 1
            yield batch
        self.epoch, self.position = self.epoch + 1, 0

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` from its beginning at the next iteration."""
        self.epoch, self.position = epoch, 0

    def micro_batch(self, index: int, width: int | None = None) -> Batch:
        """This rank's part of global micro-batch ``index`` (counted from epoch 0); no state change.
        ``width``: rows of whole samples cut there instead of at their own width (``simulate`` runs
        every step at the one width the planner is asked about)."""
        idx = self._global_rows(index)[self.dp_rank]
        rows = self.blocks[idx]
        if not isinstance(rows, dict):
            return make_batch(rows)
        if width is None and self.pad_to_multiple:
            width = self._width(idx)
        if width is not None:
            rows = {k: v[:, :width].contiguous() for k, v in rows.items()}
        return rows

    def width(self, index: int) -> int:
        """The width this rank computes micro-batch ``index`` at (its rows' lengths only)."""
        if not hasattr(self.blocks, "lengths"):
            return self.blocks.shape[1] - 1  # concatenated blocks carry one extra token for the labels
        if not self.pad_to_multiple:
            return self.blocks.shape[1]
        return self._width(self._global_rows(index)[self.dp_rank])

    def token_counts(self, index: int) -> tuple[int, int]:
        """(real, computed) tokens of global micro-batch ``index`` over every dp rank: the tokens
        that are not padding, and rows × width summed over the ranks (each rank cuts its own width).
        Read from the rows' lengths; blocks of concatenated text are real but for a padded tail."""
        parts = self._global_rows(index)
        if not hasattr(self.blocks, "lengths"):
            inputs = self.blocks[torch.cat(parts)][:, :-1]
            return int((inputs >= 0).sum()), inputs.numel()
        real = sum(int(self.blocks.lengths(idx).sum()) for idx in parts)
        full = self.blocks.shape[1]
        computed = sum(len(idx) * (self._width(idx) if self.pad_to_multiple else full) for idx in parts)
        return real, computed

    def _global_rows(self, index: int) -> list[torch.Tensor]:
        """The row indices of global micro-batch ``index`` (counted from epoch 0), one tensor per dp rank."""
        epoch, pos = divmod(index, self.steps_per_epoch)
        start = pos * self.global_micro_batch
        rows = self._permutation(epoch)[start : start + self.global_micro_batch]
        return list(rows.split(self.micro_batch_size))

    def _width(self, idx: torch.Tensor) -> int:
        longest = int(self.blocks.lengths(idx).max())
        return cut_width(longest, self.blocks.shape[1], self.pad_to_multiple, self.buckets)

    def step_micro_batches(self, step: int, grad_accum: int = 1) -> list[Batch]:
        """This rank's ``grad_accum`` micro-batches of optimizer step ``step``; no state change."""
        if grad_accum < 1:
            raise ValueError(f"grad_accum must be >= 1, got {grad_accum}")
        return [self.micro_batch(step * grad_accum + m) for m in range(grad_accum)]

    def with_dp(self, dp_rank: int, dp_size: int) -> PackedLoader:
        """A copy for another dp layout, same per-rank micro-batch size, same progress in the epoch."""
        other = PackedLoader(
            self.blocks,
            self.micro_batch_size,
            dp_rank=dp_rank,
            dp_size=dp_size,
            seed=self.seed,
            shuffle=self.shuffle,
            pad_to_multiple=self.pad_to_multiple,
            buckets=self.buckets,
        )
        other.load_state_dict(self.state_dict())
        return other

    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "position": self.position,
            "samples_in_epoch": self.position * self.global_micro_batch,
            "seed": self.seed,
            "num_blocks": self.blocks.shape[0],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume; the sample count (not the step) is restored, so it also works across dp layouts."""
        if state["seed"] != self.seed or state["num_blocks"] != self.blocks.shape[0]:
            raise ValueError(
                f"loader state is for seed={state['seed']}, num_blocks={state['num_blocks']} but this "
                f"loader has seed={self.seed}, num_blocks={self.blocks.shape[0]}; resume with the same "
                "data, sequence_len and seed"
            )
        position, rest = divmod(state["samples_in_epoch"], self.global_micro_batch)
        if rest:
            raise ValueError(
                f"loader state stopped after {state['samples_in_epoch']} samples, not a multiple of "
                f"dp_size * micro_batch_size = {self.global_micro_batch}; resume with the old global "
                "micro-batch size"
            )
        self.epoch, self.position = state["epoch"], position

    def _permutation(self, epoch: int) -> torch.Tensor:
        if self._perm_cache is None or self._perm_cache[0] != epoch:
            self._perm_cache = (
                epoch,
                epoch_permutation(self.blocks.shape[0], self.seed, epoch, self.shuffle),
            )
        return self._perm_cache[1]


def global_batch(
    blocks: torch.Tensor,
    step: int,
    *,
    micro_batch_size: int,
    dp_size: int,
    grad_accum: int = 1,
    seed: int = 0,
    shuffle: bool = True,
    pad_to_multiple: int | None = None,
    buckets: tuple[int, ...] | None = None,
) -> list[Batch]:
    """What a 1-rank run sees at optimizer ``step``: ``grad_accum`` micro-batches of ``dp_size * B`` rows.

    Rows ``[r*B, (r+1)*B)`` of micro-batch ``m`` are exactly dp rank ``r``'s micro-batch ``m``.
    """
    one_rank = PackedLoader(
        blocks,
        dp_size * micro_batch_size,
        seed=seed,
        shuffle=shuffle,
        pad_to_multiple=pad_to_multiple,
        buckets=buckets,
    )
    return one_rank.step_micro_batches(step, grad_accum)
