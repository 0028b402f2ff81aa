"""Axolotl's order of the samples (``shuffle_merged_datasets``, its default): the datasets'
examples concatenated, then shuffled once with ``seed`` (``datasets.Dataset.shuffle(seed=seed)``:
numpy's ``default_rng(seed).permutation`` of the examples), before samples too long or too short
are dropped. An example is a record, or one ``sequence_len`` piece of a raw-text document (Axolotl
cuts those at tokenisation, so its shuffle moves pieces). Rows made in this order, then drawn by the
loader's per-epoch permutation (``loader.epoch_permutation``), give each step the samples
Axolotl's trainer gives it. Written here because the samples are numpy spans of token tables, not
a ``datasets.Dataset`` to shuffle (the permutation is numpy's, as in ``datasets``)."""

from __future__ import annotations

import numpy as np

from .samples import TokenTable


def merged_order(
    tables: list[TokenTable], raw: list[bool], samples: np.ndarray, sequence_len: int, seed: int
) -> np.ndarray:
    """The indices of ``samples`` (``[n, 4]``: table, row, start, end, in dataset order) in the
    order of Axolotl's shuffled merged dataset."""
    example = np.empty(len(samples), np.int64)
    offset = 0
    for t, (table, is_raw) in enumerate(zip(tables, raw)):
        pieces = np.maximum(1, -(-table.lengths.astype(np.int64) // sequence_len)) if is_raw else None
        mine = samples[:, 0] == t
        rows = samples[mine, 1]
        if pieces is None:
            example[mine] = offset + rows
            offset += len(table)
        else:
            first = np.cumsum(pieces) - pieces
            example[mine] = offset + first[rows] + samples[mine, 2] // sequence_len
            offset += int(pieces.sum())
    position = np.empty(offset, np.int64)
    position[np.random.default_rng(seed).permutation(offset)] = np.arange(offset)
    return np.argsort(position[example], kind="stable")
