"""Rows followed by rows that train nothing, so that a validation split is evaluated to its last
row on any layout: the last global micro-batch is partial, and a dp rank left without a real row
gets a padding row (labels all -100: it adds no loss and no token to the count, but the rank still
runs the forward its FSDP / TP / CP collectives need). A split smaller than one global micro-batch
is evaluated as one partial batch, as Axolotl does."""

from __future__ import annotations

import numpy as np
import torch

from ndparallel.techniques.loss import IGNORE_INDEX


class PaddedRows:
    """``rows`` (a ``[N, S+1]`` block tensor / ``BlockStore``, or a ``RowStore``) extended to
    ``total`` rows; indices ``>= N`` are padding rows."""

    def __init__(self, rows, total: int):
        self.rows, self.n, self.total = rows, rows.shape[0], max(total, rows.shape[0])

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.total, *self.rows.shape[1:]))

    @property
    def ndim(self) -> int:
        return 2

    def __len__(self) -> int:
        return self.total

    def __getitem__(self, index):
        index = torch.as_tensor(index).reshape(-1)
        real, pads = index[index < self.n], int((index >= self.n).sum())
        part = self.rows[real] if len(real) else None
        if isinstance(part, dict) or (part is None and _is_rowstore(self.rows)):
            width = self.rows.shape[1]
            pad = {
                "input_ids": torch.zeros(pads, width, dtype=torch.int64),
                "shift_labels": torch.full((pads, width), IGNORE_INDEX, dtype=torch.int64),
                "position_ids": torch.arange(width).expand(pads, width).clone(),
            }
            if part is None:
                return pad
            return {k: torch.cat([v, pad[k].to(v.dtype)]) if k in pad else v for k, v in part.items()}
        pad = torch.full((pads, self.rows.shape[1]), IGNORE_INDEX, dtype=torch.int32)
        return (
            pad if part is None else torch.cat([torch.as_tensor(part), pad.to(torch.as_tensor(part).dtype)])
        )

    def lengths(self, index) -> np.ndarray:
        index = np.asarray(torch.as_tensor(index).reshape(-1))
        out = np.ones(len(index), dtype=np.int64)
        real = index < self.n
        if real.any():
            out[real] = self.rows.lengths(index[real])
        return out


def _is_rowstore(rows) -> bool:
    return hasattr(rows, "row_lengths")


def padded_to(rows, multiple: int):
    """``rows`` extended to a whole number of ``multiple`` rows (unchanged if it already is)."""
    total = -(-rows.shape[0] // multiple) * multiple
    return rows if total == rows.shape[0] else PaddedRows(rows, total)
