"""How wide a micro-batch of whole samples is computed (``pad_to_sequence_len: false``).

Rows of whole samples are stored padded to ``sequence_len``; without ``pad_to_sequence_len`` the
loader cuts each micro-batch after its longest row (only padding is cut), as Axolotl's collator pads
each batch to its longest sample. The width is rounded up to ``width_multiple``: at least 8 (kernel
tiles) and what the layout needs of every sequence length (``ParallelDims.seq_len_divisor``: 2·cp
under CP, cp·tp under TP + sequence parallel). The tiled MLP needs no factor: it cuts any length
(its last tile is shorter, ``techniques/tile_rule.py``).

Where a new width costs more than its padding — a recompilation under ``compile`` (and fp8, which
runs with it), a new set of stage buffers under pipeline parallel — the width is also bucketed:
the smallest of ``bucket_widths`` that holds the row, at most ``BUCKETS`` sizes per run
(``sequence_len / 2**k``, k = 0 .. BUCKETS - 1, each rounded up to the multiple), so a run meets
a handful of shapes whatever its data. Ranks that must share a shape (one tp × cp group, one
pipeline) read the same rows, so they cut the same width; dp ranks may differ.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

BUCKETS = 5
"""Widths a bucketed run uses at most: sequence_len, its half, quarter, eighth and sixteenth."""

KERNEL_MULTIPLE = 8
"""Every cut width is a multiple of this (tensor-core tiles; Axolotl's collator uses 64)."""


def width_multiple(seq_len_divisor: int) -> int:
    """What a cut width is rounded up to under a layout whose sequences must be multiples of
    ``seq_len_divisor``."""
    return math.lcm(KERNEL_MULTIPLE, seq_len_divisor)


def bucket_widths(sequence_len: int, multiple: int) -> tuple[int, ...]:
    """The widths a bucketed run may use, ascending; the last is ``sequence_len`` itself."""
    widths = {
        min(sequence_len, -(-math.ceil(sequence_len / 2**k) // multiple) * multiple) for k in range(BUCKETS)
    }
    return tuple(sorted(widths))


def cut_width(longest: int, full: int, multiple: int, buckets: Sequence[int] | None = None) -> int:
    """The width of a micro-batch whose longest row holds ``longest`` real tokens, its rows being
    ``full`` wide: rounded up to ``multiple``, then to the next bucket; never wider than ``full``."""
    width = -(-max(longest, 1) // multiple) * multiple
    if buckets:
        width = next((b for b in buckets if b >= width), full)
    return min(width, full)


MICRO_BATCHES_READ = 10_000
"""How many micro-batches the estimates below read (lengths only): enough for any run's shape."""


def padded_fraction(loader, limit: int = MICRO_BATCHES_READ) -> float | None:
    """The padded share of the tokens the ranks compute over the first ``limit`` global
    micro-batches of ``loader`` (its ``token_counts``: lengths only, no token read); None when
    it has none."""
    real = computed = 0
    for index in range(min(len(loader), limit)):
        r, c = loader.token_counts(index)
        real, computed = real + r, computed + c
    return 1.0 - real / computed if computed else None


PLANNED_QUANTILE = 0.95
"""Where the planner sizes a run of cut micro-batches: the width 95 % of them fit."""


def width_quantile(loader, q: float = PLANNED_QUANTILE, limit: int = MICRO_BATCHES_READ) -> int:
    """The width that a share ``q`` of ``loader``'s micro-batches (its first ``limit``) are computed
    at or under: one of the widths the run computes (nearest rank, no interpolation)."""
    widths = sorted(loader.width(index) for index in range(min(len(loader), limit)))
    return widths[max(0, math.ceil(q * len(widths)) - 1)]
