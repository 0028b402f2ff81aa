"""Rows of whole samples, ready to train, in memory-mapped column files shared by a node's ranks.

A row holds one sample (``sample_packing: false``) or several (``true``), then padding up to
``sequence_len``. Stored per row, in one ``.npy`` file per column (int32), so host memory per rank
does not grow with the dataset (pages live once in the node's page cache, as ``store.BlockStore``):

* ``input_ids``   the tokens; padding = the tokenizer's pad (else eos) id;
* ``shift_labels`` already shifted: ``shift_labels[t]`` = the label of token ``t+1`` of the same
  sample; -100 for untrained tokens, for each sample's last position (the next token belongs to
  another sample) and for padding;
* ``position_ids`` 0, 1, ... restarting at each sample (transformers' packed-sequence convention:
  attention must not cross a restart); padding continues the last sample's positions, so it is
  part of no new sample and, being after every real token, is never attended by one;
* ``lengths``     real (non-padding) tokens per row, ``[n]``.

12 bytes per token on disk (three int32 columns). ``RowStore[idx]`` gives the batch dict the
trainer uses; ``select`` makes row-index views (train / validation split) without copying.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import torch

from ndparallel.techniques.loss import IGNORE_INDEX

from .bins import rows_of
from .samples import TokenTable

COLUMNS = ("input_ids", "shift_labels", "position_ids")


class RowStore:
    """Rows ``rows`` (all when None) of the column arrays ``[n, sequence_len]``."""

    def __init__(self, columns: dict[str, np.ndarray], lengths: np.ndarray, rows: np.ndarray | None = None):
        self.columns, self.row_lengths, self.rows = columns, lengths, rows

    @classmethod
    def open(cls, directory: str | os.PathLike) -> RowStore:
        d = Path(directory)
        return cls(
            {c: np.load(d / f"{c}.npy", mmap_mode="r") for c in COLUMNS},
            np.load(d / "lengths.npy", mmap_mode="r"),
        )

    @property
    def shape(self) -> torch.Size:
        n = self.columns["input_ids"].shape[0] if self.rows is None else len(self.rows)
        return torch.Size((n, self.columns["input_ids"].shape[1]))

    @property
    def ndim(self) -> int:
        return 2

    def __len__(self) -> int:
        return self.shape[0]

    def _index(self, index):
        if isinstance(index, torch.Tensor):
            index = index.numpy()
        if isinstance(index, (int, np.integer)):
            index = [int(index)]
        return index if self.rows is None else self.rows[index]

    def __getitem__(self, index) -> dict[str, torch.Tensor]:
        """Rows ``index`` as the batch dict (int64 tensors ``[b, sequence_len]``)."""
        index = self._index(index)
        return {c: torch.from_numpy(np.array(self.columns[c][index], dtype=np.int64)) for c in COLUMNS}

    def lengths(self, index) -> np.ndarray:
        """Real tokens of rows ``index``."""
        return np.asarray(self.row_lengths[self._index(index)])

    def select(self, rows) -> RowStore:
        rows = np.asarray(rows.numpy() if isinstance(rows, torch.Tensor) else rows, dtype=np.int64)
        return RowStore(self.columns, self.row_lengths, rows if self.rows is None else self.rows[rows])


def write_rows(
    tables: list[TokenTable],
    samples: np.ndarray,
    row_of: np.ndarray,
    sequence_len: int,
    pad_id: int,
    directory: Path | None,
    meta: dict,
    boundary_targets: int | None = None,
) -> RowStore:
    """Write the rows (``row_of[k]``: the row of ``samples[k]``; rows numbered from 0) to
    ``directory`` (built in a temporary directory, then renamed: it appears complete or not at
    all); ``None``: in memory. ``boundary_targets`` (the BOS id, or -1 when there is none):
    Axolotl's packed labels (``_boundary_target``)."""
    order, starts = rows_of(row_of)
    tmp = None
    if directory is not None:
        tmp = directory.with_name(f".{directory.name}.tmp-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)

    def alloc(name: str, shape: tuple[int, ...]) -> np.ndarray:
        if tmp is None:
            return np.empty(shape, np.int32)
        return np.lib.format.open_memmap(tmp / f"{name}.npy", mode="w+", dtype=np.int32, shape=shape)

    n_rows = len(starts) - 1
    out = {c: alloc(c, (n_rows, sequence_len)) for c in COLUMNS}
    lengths = alloc("lengths", (n_rows,))
    _fill(tables, samples, order, starts, sequence_len, pad_id, out, lengths, boundary_targets)
    if tmp is None:
        return RowStore(out, lengths)
    for array in (*out.values(), lengths):
        array.flush()
    del out, lengths
    (tmp / "meta.json").write_text(json.dumps(meta, indent=1, sort_keys=True))
    os.replace(tmp, directory)
    return RowStore.open(directory)


def _fill(
    tables: list[TokenTable],
    samples: np.ndarray,
    order: np.ndarray,
    starts: np.ndarray,
    sequence_len: int,
    pad_id: int,
    out: dict[str, np.ndarray],
    lengths: np.ndarray,
    boundary_targets: int | None = None,
) -> None:
    ramp = np.arange(sequence_len, dtype=np.int32)
    for r in range(len(starts) - 1):
        members = order[starts[r] : starts[r + 1]]
        ids_row, lab_row, pos_row = out["input_ids"][r], out["shift_labels"][r], out["position_ids"][r]
        offset = 0
        for i, k in enumerate(members):
            table, row, start, end = (int(v) for v in samples[k])
            ids, labels = tables[table].get(row)
            n = end - start
            ids_row[offset : offset + n] = ids[start:end]
            lab_row[offset : offset + n - 1] = labels[start + 1 : end]
            lab_row[offset + n - 1] = IGNORE_INDEX
            if boundary_targets is not None and i + 1 < len(members):
                lab_row[offset + n - 1] = _boundary_target(tables, samples[members[i + 1]], boundary_targets)
            pos_row[offset : offset + n] = ramp[:n]
            offset += n
        ids_row[offset:] = pad_id
        lab_row[offset:] = IGNORE_INDEX
        last = int(pos_row[offset - 1]) + 1
        pos_row[offset:] = ramp[last : last + sequence_len - offset]
        lengths[r] = offset


def _boundary_target(tables: list[TokenTable], sample: np.ndarray, bos: int | None) -> int:
    """The label Axolotl's packed row gives the token before ``sample``: its first token where
    Axolotl's labels train it (labels = input_ids there: a trained first token, or a BOS the
    tokenizer added before a trained token, whose label ndparallel leaves at -100), else -100."""
    table, row, start, end = (int(v) for v in sample)
    ids, labels = tables[table].get(row)
    if labels[start] != IGNORE_INDEX:
        return int(labels[start])
    if bos is not None and ids[start] == bos and end - start > 1 and labels[start + 1] != IGNORE_INDEX:
        return int(ids[start])
    return IGNORE_INDEX
