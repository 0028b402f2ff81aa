"""Memory and time of ``dataset_exact_deduplication`` against the number of samples.

``first_occurrences`` keeps one 16-byte digest per distinct sample in a Python set (the bound
docs/data.md states). For N and 10·N generated samples (short token rows, a tenth of them repeats of
earlier ones) in one Arrow table, as the data pipeline holds them, it reports the Python/numpy
allocation peak of the call (tracemalloc: the set, the digests, the chunked rows, the result), bytes
per distinct sample, and seconds. The two runs give the cost of one more distinct sample (the slope:
the set entry, its digest, the kept row of the result) and the fixed part (one chunk of rows as
Python ints). Goal: a slope under 160 bytes per distinct sample and a fixed part under 24 MB (from
N = 100,000 on: below that the set's resizing steps dominate the slope).

    python bench/dedup_memory.py                 # N = 100,000; table + bench/results/dedup_memory.json
    python bench/dedup_memory.py --samples 1000000
"""

from __future__ import annotations

import argparse
import sys
import time
import tracemalloc
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import print_table, write_json  # noqa: E402

from ndparallel.data.samples import TokenTable, first_occurrences  # noqa: E402

TOKENS = 16


def table_of(n: int, seed: int = 0) -> tuple[TokenTable, np.ndarray, int]:
    """``n`` rows of ``TOKENS`` tokens, every tenth a repeat of an earlier row; the samples array
    (table, row, start, end) over all of them; the number of distinct rows."""
    import datasets
    import pyarrow as pa

    rng = np.random.default_rng(seed)
    ids = rng.integers(0, 50_000, size=(n, TOKENS), dtype=np.int32)
    repeat = np.arange(n) % 10 == 9
    ids[repeat] = ids[rng.integers(0, n // 2, size=int(repeat.sum()))]  # earlier rows' tokens
    offsets = np.arange(0, n * TOKENS + 1, TOKENS, dtype=np.int32)
    column = pa.ListArray.from_arrays(pa.array(offsets), pa.array(ids.reshape(-1)))
    ds = datasets.Dataset(pa.table({"input_ids": column, "labels": column}))
    samples = np.stack(
        [np.zeros(n, np.int64), np.arange(n), np.zeros(n, np.int64), np.full(n, TOKENS, np.int64)], axis=1
    )
    distinct = len(np.unique(ids, axis=0))
    return TokenTable(ds), samples, distinct


def measure(n: int) -> dict:
    table, samples, distinct = table_of(n)
    tracemalloc.start()
    start = time.perf_counter()
    kept = first_occurrences([table], samples)
    seconds = time.perf_counter() - start
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert len(kept) == distinct, (len(kept), distinct)
    return {
        "samples": n,
        "distinct": distinct,
        "peak_mb": peak / 2**20,
        "bytes_per_distinct": peak / distinct,
        "seconds": seconds,
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=100_000, help="N, the smaller count")
    args = parser.parse_args(argv)
    rows = [measure(args.samples * k) for k in (1, 10)]
    small, large = rows
    slope = (large["peak_mb"] - small["peak_mb"]) * 2**20 / (large["distinct"] - small["distinct"])
    fixed_mb = small["peak_mb"] - slope * small["distinct"] / 2**20
    print_table(
        "dataset_exact_deduplication: allocation peak of first_occurrences (tracemalloc)",
        ["samples", "distinct", "peak MB", "bytes / distinct", "seconds"],
        [
            [
                f"{r['samples']:,}",
                f"{r['distinct']:,}",
                f"{r['peak_mb']:.1f}",
                f"{r['bytes_per_distinct']:.0f}",
                f"{r['seconds']:.1f}",
            ]
            for r in rows
        ],
    )
    print(
        f"each more distinct sample: {slope:.0f} bytes; fixed part {fixed_mb:.1f} MB; "
        f"so ~{(fixed_mb + slope * 1e6 / 2**20) / 1024:.2f} GB per million distinct samples "
        f"({large['seconds'] / large['samples'] * 1e6:.0f} s per million samples here)"
    )
    ok = slope < 160 and fixed_mb < 24
    print(f"goal: < 160 bytes per distinct sample and a fixed part < 24 MB: {'met' if ok else 'NOT met'}")
    path = write_json(
        "dedup_memory",
        {"rows": rows, "bytes_per_distinct_sample": slope, "fixed_mb": fixed_mb, "goal_met": ok},
    )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
