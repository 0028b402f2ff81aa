"""Packed token blocks in a memory-mapped file, shared by the ranks of a node.

``pack_to_file`` streams a tokenized dataset (itself memory-mapped Arrow) into an ``.npy`` file of
``[num_blocks, block_size]`` int32, one Arrow chunk at a time: packing holds O(chunk) in memory,
not O(dataset). Every rank then maps the same file read-only (``BlockStore``): the pages live once
in the node's page cache, and a rank's resident memory grows only with the blocks it reads, not
with the dataset. A ``BlockStore`` behaves like the 2-D tensor the loader indexes (``shape``,
``ndim``, ``store[index_tensor]`` → a tensor copy of those rows); a train/validation split is a
pair of row-index views of one file (``select``), never a copy.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch


class BlockStore:
    """Rows ``rows`` (all when None) of a 2-D int32 array, usually an ``np.memmap``."""

    def __init__(self, array: np.ndarray, rows: np.ndarray | None = None):
        if array.ndim != 2:
            raise ValueError(f"a block store holds a 2-D array, got shape {array.shape}")
        self.array = array
        self.rows = rows

    @classmethod
    def open(cls, path: str | os.PathLike) -> BlockStore:
        return cls(np.load(path, mmap_mode="r"))

    @property
    def shape(self) -> torch.Size:
        n = self.array.shape[0] if self.rows is None else len(self.rows)
        return torch.Size((n, self.array.shape[1]))

    @property
    def ndim(self) -> int:
        return 2

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, index) -> torch.Tensor:
        """Rows ``index`` (an int, slice, or integer tensor/array) as a new int32 tensor."""
        if isinstance(index, torch.Tensor):
            index = index.numpy()
        if self.rows is not None:
            index = self.rows[index]
        if isinstance(index, (int, np.integer)):
            index = [index]
        return torch.from_numpy(np.array(self.array[index], dtype=np.int32))

    def select(self, rows) -> BlockStore:
        """A view of some of this store's rows (indices into this store), in the given order."""
        rows = np.asarray(rows.numpy() if isinstance(rows, torch.Tensor) else rows, dtype=np.int64)
        return BlockStore(self.array, rows if self.rows is None else self.rows[rows])


def count_tokens(column: pa.ChunkedArray) -> int:
    """Total tokens of a list<int> column from its list lengths (no token is read)."""
    return int(pc.sum(pc.list_value_length(column)).as_py() or 0)


def pack_to_file(
    column: pa.ChunkedArray, block_size: int, path: Path, pad_tail: bool, pad_value: int
) -> Path:
    """Write the concatenated token lists of ``column`` as ``[n, block_size]`` int32 rows to ``path``
    (tmp file + rename: the file appears complete or not at all). The ragged tail is dropped, or
    padded with ``pad_value`` into one more row when ``pad_tail``."""
    total = count_tokens(column)
    n_full, rest = divmod(total, block_size)
    n_rows = n_full + (1 if pad_tail and rest else 0)
    if n_full == 0:
        raise ValueError(
            f"dataset too small: it gives {total} tokens, fewer than one block of "
            f"sequence_len + 1 = {block_size}; lower sequence_len or add data"
        )
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    out = np.lib.format.open_memmap(tmp, mode="w+", dtype=np.int32, shape=(n_rows, block_size))
    flat = out.reshape(-1)
    pos, limit = 0, n_rows * block_size if pad_tail else n_full * block_size
    for chunk in column.chunks:
        if pos >= limit:
            break
        values = chunk.flatten().to_numpy(zero_copy_only=False)[: limit - pos]
        flat[pos : pos + len(values)] = values
        pos += len(values)
    flat[pos:limit] = pad_value
    out.flush()
    del out, flat
    os.replace(tmp, path)
    return path
