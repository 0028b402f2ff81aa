"""Tokenized samples as numpy views of their Arrow files, and the choice of what fits a row.

``TokenTable`` gives sample ``i``'s ``input_ids`` and ``labels`` as zero-copy numpy views of the
(memory-mapped) Arrow columns ``tokenize_samples`` wrote: no sample is copied into Python lists.

``select_samples`` decides, per sample, the token span that goes into rows of ``sequence_len``:
raw text longer than a row is cut into consecutive pieces (nothing is lost); a fine-tuning sample
longer than a row is dropped (``excess_length_strategy: drop``, the default, as Axolotl) or
truncated (``truncate``); samples left with no trained label (nothing to learn: e.g. only a prompt) are
dropped. The result is an ``[n, 4]`` array of ``(table, row, start, end)`` and the counts.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import datasets
import numpy as np

from ndparallel.techniques.loss import IGNORE_INDEX


class TokenTable:
    """Per-sample numpy views of a tokenized dataset's ``input_ids`` and ``labels``."""

    def __init__(self, ds: datasets.Dataset):
        if getattr(ds, "_indices", None) is not None:
            raise ValueError(
                "a TokenTable needs a dataset without an indices mapping (flatten_indices first)"
            )
        self.columns = {name: _Column(ds.data.column(name)) for name in ("input_ids", "labels")}

    def __len__(self) -> int:
        return len(self.columns["input_ids"].lengths)

    @property
    def lengths(self) -> np.ndarray:
        return self.columns["input_ids"].lengths

    def get(self, row: int) -> tuple[np.ndarray, np.ndarray]:
        return self.columns["input_ids"].get(row), self.columns["labels"].get(row)

    def trained_counts(self, starts: np.ndarray, ends: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """Trained labels of each span after the shift (``labels[start+1:end]`` that are not -100)."""
        return self.columns["labels"].count_not(IGNORE_INDEX, rows, starts + 1, ends)


class _Column:
    """A list<int32> Arrow column: per-chunk offsets and values as numpy (zero copy)."""

    def __init__(self, column):
        self.offsets = [c.offsets.to_numpy() for c in column.chunks]
        self.values = [c.values.to_numpy(zero_copy_only=False) for c in column.chunks]
        counts = [len(o) - 1 for o in self.offsets]
        self.chunk_start = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        self.lengths = (
            np.concatenate([np.diff(o) for o in self.offsets]) if self.offsets else np.zeros(0, np.int64)
        ).astype(np.int64)

    def get(self, row: int) -> np.ndarray:
        c = int(np.searchsorted(self.chunk_start, row, side="right")) - 1
        i = row - int(self.chunk_start[c])
        return self.values[c][self.offsets[c][i] : self.offsets[c][i + 1]]

    def count_not(self, value: int, rows: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
        """For each (row, start, end): how many of ``row[start:end]`` differ from ``value``."""
        out = np.zeros(len(rows), np.int64)
        chunk = np.searchsorted(self.chunk_start, rows, side="right") - 1
        for c in np.unique(chunk):
            sel = np.nonzero(chunk == c)[0]
            prefix = np.concatenate([[0], np.cumsum(self.values[c] != value)])
            base = self.offsets[c][rows[sel] - self.chunk_start[c]].astype(np.int64)
            lo = base + np.minimum(starts[sel], ends[sel])
            out[sel] = prefix[base + ends[sel]] - prefix[lo]
        return out


@dataclass
class SelectionStats:
    records: int = 0
    samples: int = 0
    truncated: int = 0
    dropped_too_long: int = 0
    dropped_untrained: int = 0
    dropped_too_short: int = 0
    pieces_from_split: int = 0
    dropped_duplicates: int = 0

    def as_dict(self) -> dict:
        return asdict(self)


def select_samples(
    tables: list[TokenTable],
    raw: list[bool],
    sequence_len: int,
    excess_length_strategy: str = "drop",
    min_len: int | None = None,
) -> tuple[np.ndarray, SelectionStats]:
    """``(table, row, start, end)`` of every sample that goes into rows, in dataset order. With
    ``min_len``, samples (raw documents before they are cut) of fewer tokens are dropped (Axolotl's
    ``min_sample_len``);
    ``excess_length_strategy: raise`` refuses a fine-tuning sample longer than ``sequence_len``."""
    if excess_length_strategy not in ("truncate", "drop", "raise"):
        raise ValueError(
            f"excess_length_strategy: {excess_length_strategy!r}; use 'truncate', 'drop' or 'raise'"
        )
    stats = SelectionStats()
    parts = []
    for t, (table, is_raw) in enumerate(zip(tables, raw)):
        lengths = table.lengths
        stats.records += len(lengths)
        rows = np.arange(len(lengths), dtype=np.int64)
        if min_len:
            short = lengths < min_len
            stats.dropped_too_short += int(short.sum())
            rows = rows[~short]
        if is_raw:  # consecutive pieces of at most sequence_len tokens
            n_pieces = np.maximum(1, -(-lengths[rows] // sequence_len))
            stats.pieces_from_split += int((n_pieces - 1).sum())
            rows = np.repeat(rows, n_pieces)
            first = np.repeat(np.cumsum(n_pieces) - n_pieces, n_pieces)
            starts = (np.arange(len(rows)) - first) * sequence_len
            ends = np.minimum(starts + sequence_len, lengths[rows])
        else:
            long = lengths[rows] > sequence_len
            if excess_length_strategy == "raise" and long.any():
                row = int(rows[long][0])
                raise ValueError(
                    f"datasets[{t}] row {row}: {int(lengths[row])} tokens, longer than sequence_len="
                    f"{sequence_len} (excess_length_strategy: raise); raise sequence_len, or set "
                    "excess_length_strategy: truncate or drop"
                )
            if excess_length_strategy == "drop":
                stats.dropped_too_long += int(long.sum())
                rows = rows[~long]
            else:
                stats.truncated += int(long.sum())
            starts = np.zeros(len(rows), np.int64)
            ends = np.minimum(lengths[rows], sequence_len)
        trained = table.trained_counts(starts, ends, rows) if len(rows) else np.zeros(0, np.int64)
        keep = trained > 0
        stats.dropped_untrained += int((~keep).sum())
        parts.append(np.stack([np.full(int(keep.sum()), t), rows[keep], starts[keep], ends[keep]], axis=1))
    samples = np.concatenate(parts).astype(np.int64) if parts else np.zeros((0, 4), np.int64)
    stats.samples = len(samples)
    return samples, stats


def first_occurrences(tables: list[TokenTable], samples: np.ndarray) -> np.ndarray:
    """The samples (rows of ``select_samples``' array) whose tokens and labels no earlier sample has
    (Axolotl's ``dataset_exact_deduplication``). One 16-byte digest per distinct sample is held
    (a Python ``bytes`` in a set: ~110 bytes per distinct sample, measured by
    ``bench/dedup_memory.py``), plus a bool per sample; the rows are read in chunks."""
    import hashlib

    seen: set[bytes] = set()
    keep = np.zeros(len(samples), dtype=bool)
    for first in range(0, len(samples), _DEDUP_CHUNK):
        chunk = samples[first : first + _DEDUP_CHUNK].tolist()  # Python ints: bounded, not O(samples)
        for k, (table, row, start, end) in enumerate(chunk, start=first):
            ids, labels = tables[table].get(row)
            digest = hashlib.blake2b(np.ascontiguousarray(ids[start:end]).tobytes(), digest_size=16)
            digest.update(np.ascontiguousarray(labels[start:end]).tobytes())
            key = digest.digest()
            if key not in seen:
                seen.add(key)
                keep[k] = True
    return samples[keep]


_DEDUP_CHUNK = 1 << 16
