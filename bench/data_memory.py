"""Host memory per rank against dataset size: the packed token store is memory-mapped and shared by
a node's ranks, so a rank's peak RSS must not grow with the dataset.

For a generated jsonl corpus of S and 10·S bytes: 2 FSDP ranks (forked, fresh) build the data the
way ``ndparallel train`` does (tokenize → pack into the cache → memory-map; rank 0 builds, rank 1
waits on the file lock), train a tiny Llama a few steps, and report each rank's peak RSS (VmHWM).
Goal (issue #13): the 10·S run's peak RSS per rank is < 1.10 × the S run's.

    python bench/data_memory.py             # S = 8 MB of text; table + bench/results/data_memory.json
    python bench/data_memory.py --mb 2      # quicker
    python bench/data_memory.py --sample-packing   # whole samples packed into rows (issue #16)

With ``--sample-packing`` the data is prepared first in a separate process, as ``ndparallel train``
does before launching the ranks (its private peak is reported too: building the rows holds a few
arrays of O(samples)); the ranks then only map the cached rows.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import transformers  # noqa: F401  (imported once before forking the ranks)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import AnonPeak, print_table, vm_bytes, write_json  # noqa: E402

from ndparallel.testing import run_on_ranks  # noqa: E402

WORDS = [f"w{i}" for i in range(5000)]


def write_corpus(path: Path, megabytes: float, seed: int = 0) -> Path:
    """Lines of random words: ``megabytes`` of jsonl text, deterministic."""
    rng = random.Random(seed)
    target, written = int(megabytes * 2**20), 0
    with open(path, "w") as f:
        while written < target:
            line = json.dumps({"text": " ".join(rng.choices(WORDS, k=200))}) + "\n"
            f.write(line)
            written += len(line)
    return path


def _config(data: str, cache: str, steps: int, packing: bool):
    from ndparallel.axolotl import load_config

    return load_config(
        None,
        [
            "base_model=tiny-llama",
            f"datasets=[{{path: '{data}'}}]",
            "tokenizer_vocab_size=512",
            "tokenizer=builtin:stdlib",
            "sequence_len=128",
            "dp_shard_size=2",
            f"max_steps={steps}",
            f"dataset_cache_dir={cache}",
            f"output_dir={cache}/run",
            "save_final_model=false",
            *(["sample_packing=true"] if packing else []),
        ],
    )


def _prepare(data: str, cache: str, steps: int, packing: bool) -> dict:
    """What ``ndparallel train`` does before launching the ranks: the whole data preparation."""
    from ndparallel.preflight.local import prepare_data

    anon = AnonPeak()
    prepare_data(_config(data, cache, steps, packing))
    return {"peak_anon": anon.stop()}


def _rank(data: str, cache: str, steps: int, packing: bool = False) -> dict:
    from ndparallel.training.trainer import Trainer

    cfg = _config(data, cache, steps, packing)
    anon = AnonPeak()
    trainer = Trainer(cfg)
    trainer.setup()
    trainer._start_outputs()
    trainer.progress = type("Quiet", (), {"update": lambda *a: None, "close": lambda *a: None})()
    trainer._log_time, trainer._log_step = time.perf_counter(), 0  # what Trainer.run sets before step 1
    for _ in range(steps):
        trainer.log(trainer.train_step())
    return {"peak_rss": vm_bytes("VmHWM:"), "peak_anon": anon.stop(), "blocks": len(trainer.splits.train)}


def measure(megabytes: float, steps: int, workdir: Path, packing: bool = False) -> dict:
    data = write_corpus(workdir / f"corpus-{megabytes}.jsonl", megabytes)
    args = (str(data), str(workdir / f"cache-{megabytes}"), steps, packing)
    prepared = run_on_ranks(_prepare, 1, *args, timeout_s=1800)[0] if packing else None
    ranks = run_on_ranks(_rank, 2, *args, timeout_s=1800)
    return {
        "megabytes": megabytes,
        "blocks": ranks[0]["blocks"],
        "prepare_anon_mb": prepared["peak_anon"] / 2**20 if prepared else None,
        "peak_rss_mb": [r["peak_rss"] / 2**20 for r in ranks],
        "peak_anon_mb": [r["peak_anon"] / 2**20 for r in ranks],
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=float, default=8.0, help="size S of the small corpus, MB of text")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument(
        "--sample-packing", action="store_true", help="rows of whole samples (sample_packing)"
    )
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        rows = [measure(args.mb * k, args.steps, Path(tmp), args.sample_packing) for k in (1, 10)]
    small, large = rows
    ratios = {k: [b / a for a, b in zip(small[k], large[k])] for k in ("peak_rss_mb", "peak_anon_mb")}
    print_table(
        "peak memory per rank (MB) vs dataset size: RSS (incl. mapped file pages) | private",
        ["dataset", "blocks", "RSS r0", "RSS r1", "private r0", "private r1"],
        [
            [
                f"{r['megabytes']:.0f} MB",
                r["blocks"],
                *(f"{m:.0f}" for m in r["peak_rss_mb"]),
                *(f"{m:.0f}" for m in r["peak_anon_mb"]),
            ]
            for r in rows
        ]
        + [["10× / 1×", "", *(f"{x:.3f}" for x in ratios["peak_rss_mb"] + ratios["peak_anon_mb"])]],
    )
    if args.sample_packing:
        print(
            "private peak of the process that prepared the data (before the ranks): "
            + " -> ".join(f"{r['prepare_anon_mb']:.0f} MB ({r['megabytes']:.0f} MB of text)" for r in rows)
        )
    ok = max(ratios["peak_anon_mb"]) < 1.10
    print(
        f"goal: 10× data grows the private (non-file) peak per rank by < 10 %: "
        f"{'met' if ok else 'NOT met'} (max ratio {max(ratios['peak_anon_mb']):.3f}); mapped file "
        "pages are shared by the node's ranks and evictable page cache"
    )
    path = write_json(
        "data_memory_packed" if args.sample_packing else "data_memory",
        {"rows": rows, "ratios": ratios, "goal_met": ok},
    )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
