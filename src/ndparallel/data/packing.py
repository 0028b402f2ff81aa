"""Pack tokenized documents into fixed-size blocks and split off a validation set.

Documents (each already ending with eos) are concatenated in order into one token stream,
cut into blocks of ``sequence_len + 1`` tokens: a block gives ``input_ids = block[:-1]`` and
``shift_labels = block[1:]``. The ragged tail is dropped by default; with ``pad_tail=True`` it
becomes one more block padded with ``IGNORE_INDEX`` (-100), which the loader turns into ignored
labels (and token 0 in ``input_ids``, never attended by a real token under causal attention).
With a cache directory (what ``ndparallel train`` uses) the blocks are packed once into a
memory-mapped file that every rank of a node shares (``store.BlockStore``): host memory per rank
does not grow with the dataset. Without one they are an in-memory tensor (tests, small data).
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import datasets
import numpy as np
import pyarrow.compute as pc
import torch
from filelock import FileLock
from transformers import PreTrainedTokenizerBase

from ndparallel.techniques.loss import IGNORE_INDEX

from .dataset import DatasetSpec, load_text_datasets, tokenize_dataset
from .store import BlockStore, pack_to_file


def pack_blocks(
    tokenized: datasets.Dataset,
    block_size: int,
    pad_tail: bool = False,
    cache_dir: str | os.PathLike | None = None,
) -> torch.Tensor | BlockStore:
    """Concatenate ``input_ids`` into ``[num_blocks, block_size]`` int32 rows. With ``cache_dir``
    they are written once (file-locked: one rank of a node packs, the others wait) to a
    memory-mapped file shared by the node's ranks (a ``BlockStore``); without, an in-memory tensor."""
    if block_size < 2:
        raise ValueError(f"block_size (sequence_len + 1) must be >= 2, got {block_size}")
    column = tokenized.with_format("arrow")["input_ids"]
    if cache_dir is not None:
        out_dir = Path(cache_dir) / "packed"
        out_dir.mkdir(parents=True, exist_ok=True)
        path = out_dir / f"{tokenized._fingerprint}-b{block_size}{'-padded' if pad_tail else ''}.npy"
        with FileLock(str(path) + ".lock"):
            if not path.is_file():
                pack_to_file(column, block_size, path, pad_tail, IGNORE_INDEX)
        return BlockStore.open(path)
    flat = torch.from_numpy(pc.list_flatten(column).to_numpy().astype(np.int32))  # astype copies: writable
    n_full, rest = divmod(flat.numel(), block_size)
    if n_full == 0:
        raise ValueError(
            f"dataset too small: it gives {flat.numel()} tokens, fewer than one block of "
            f"sequence_len + 1 = {block_size}; lower sequence_len or add data"
        )
    blocks = flat[: n_full * block_size].view(n_full, block_size)
    if pad_tail and rest:
        tail = torch.full((1, block_size), IGNORE_INDEX, dtype=torch.int32)
        tail[0, :rest] = flat[n_full * block_size :]
        blocks = torch.cat([blocks, tail])
    return blocks


def split_blocks(
    blocks: torch.Tensor | BlockStore, val_set_size: float | int, seed: int = 0
) -> tuple[torch.Tensor | BlockStore, torch.Tensor | BlockStore | None]:
    """Split ``(train, val)`` at block level, deterministically by ``seed``.

    ``val_set_size``: ``0`` = no validation set, a float in (0, 1) = fraction (rounded up), an
    int >= 1 = number of blocks. Both parts keep the original block order.
    """
    n = blocks.shape[0]
    if isinstance(val_set_size, bool) or not isinstance(val_set_size, (int, float)) or val_set_size < 0:
        raise ValueError(f"val_set_size must be a fraction in [0, 1) or a block count, got {val_set_size!r}")
    if val_set_size == 0:
        return blocks, None
    if isinstance(val_set_size, float) and val_set_size < 1:
        n_val = math.ceil(val_set_size * n)
    elif float(val_set_size).is_integer():
        n_val = int(val_set_size)
    else:
        raise ValueError(
            f"val_set_size {val_set_size!r}: use a fraction in (0, 1) or a whole number of blocks"
        )
    if n_val >= n:
        raise ValueError(
            f"val_set_size={val_set_size!r} takes {n_val} of {n} blocks, leaving none to train on; "
            "lower val_set_size or sequence_len, or add data"
        )
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    val_idx, _ = perm[:n_val].sort()
    train_idx, _ = perm[n_val:].sort()
    if not isinstance(blocks, torch.Tensor):  # a BlockStore / RowStore: views of the files, no copy
        return blocks.select(train_idx), blocks.select(val_idx)
    return blocks[train_idx], blocks[val_idx]


@dataclass(frozen=True)
class PackedSplits:
    """Rows for training and, optionally, validation: concatenated blocks ``[N, sequence_len + 1]``
    (int32 tensors, or views of one memory-mapped file: ``BlockStore``), or whole samples
    (``rows.RowStore``, see ``pipeline.py``)."""

    train: torch.Tensor | BlockStore
    val: torch.Tensor | BlockStore | None


def build_blocks(
    specs: Iterable[DatasetSpec | Mapping[str, Any] | str],
    tokenizer: PreTrainedTokenizerBase,
    sequence_len: int,
    *,
    val_set_size: float | int = 0,
    seed: int = 0,
    cache_dir: str | os.PathLike | None = None,
    num_proc: int | None = None,
    pad_tail: bool = False,
) -> PackedSplits:
    """Load, tokenize (cached), pack and split: the whole pipeline from specs to blocks."""
    text = load_text_datasets(specs, cache_dir)
    tokenized = tokenize_dataset(text, tokenizer, cache_dir, num_proc)
    packed = pack_blocks(tokenized, sequence_len + 1, pad_tail, cache_dir=cache_dir)
    train, val = split_blocks(packed, val_set_size, seed)
    return PackedSplits(train, val)
