"""Compilations under ``compile`` when micro-batches are cut after their longest row
(``pad_to_sequence_len: false``): the widths a run meets, with and without the trainer's buckets
(``data/widths.py``), and how many times dynamo compiles the decoder layers for them.

Rows of whole samples with lengths spread over (8, sequence_len] (a synthetic ``RowStore``) go
through the trainer's loader (``PackedLoader``) and the engine's ``train_step`` with regional
compilation (``techniques/compile.py``) on one process: once with the widths only rounded to 8,
once bucketed (what the trainer does under compile, fp8 and pipeline parallel). Counted: the
distinct widths, and dynamo's compiled frames (``torch._dynamo.utils.counters``: the first width's
graph, then a recompilation when a dimension changes; dynamo's automatic dynamic shapes then make
the sequence dimension dynamic, so later widths reuse that graph). Fails when a run compiles more
than once per width bucket plus one.

    python bench/dynamic_widths.py                 # CPU, inductor
    python bench/dynamic_widths.py --device cuda   # one GPU
    python bench/dynamic_widths.py --tiny          # bench/gpu_all.sh --cpu-smoke: dynamo's eager backend
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import write_json  # noqa: E402

from ndparallel.testing import run_on_ranks  # noqa: E402


def synthetic_rows(n: int, seq: int, vocab: int, seed: int = 0):
    """``n`` one-sample rows of ``seq`` columns, lengths uniform in [8, seq] (a ``RowStore``)."""
    import numpy as np

    from ndparallel.data.rows import RowStore

    rng = np.random.default_rng(seed)
    lengths = rng.integers(8, seq + 1, n).astype(np.int32)
    ids = rng.integers(0, vocab, (n, seq)).astype(np.int32)
    labels = np.roll(ids, -1, 1)
    labels[np.arange(seq) >= lengths[:, None] - 1] = -100
    positions = np.broadcast_to(np.arange(seq, dtype=np.int32), (n, seq)).copy()
    return RowStore({"input_ids": ids, "shift_labels": labels, "position_ids": positions}, lengths)


def measure(bucketed: bool, seq: int, steps: int, device: str, backend: str) -> dict:
    import torch
    from torch._dynamo.utils import counters
    from transformers import AutoModelForCausalLM

    from ndparallel import ParallelismConfig
    from ndparallel.data import PackedLoader
    from ndparallel.data.widths import bucket_widths, width_multiple
    from ndparallel.engine import Engine, batch_to_device, train_step
    from ndparallel.models.presets import preset_config
    from ndparallel.parallel.options import StrategyOptions
    from ndparallel.techniques.technique_options import CompileOptions

    torch._dynamo.reset()
    counters.clear()
    engine = Engine(
        ParallelismConfig(),
        StrategyOptions(compile=CompileOptions(enabled=True, backend=backend)),
        device=device,
    )
    config = preset_config("tiny-llama")
    config.use_cache = False
    torch.manual_seed(0)
    model = engine.parallelize(AutoModelForCausalLM.from_config(config))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    multiple = width_multiple(engine.seq_len_divisor())
    buckets = bucket_widths(seq, multiple) if bucketed else None
    loader = PackedLoader(
        synthetic_rows(8 * steps, seq, config.vocab_size), 2, pad_to_multiple=multiple, buckets=buckets
    )
    widths = []
    for step in range(steps):
        batch = loader.micro_batch(step)
        widths.append(batch["input_ids"].shape[1])
        train_step(engine, model, optimizer, [batch_to_device(batch, engine.device)])
    return {
        "bucketed": bucketed,
        "widths": widths,
        "distinct_widths": len(set(widths)),
        "buckets": list(buckets or []),
        "compiled_frames": int(counters["frames"]["total"]),
        "unique_graphs": int(counters["stats"]["unique_graphs"]),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--tiny", action="store_true", help="the CPU smoke form (dynamo's eager backend)")
    parser.add_argument("--seq", type=int, default=None)
    parser.add_argument("--steps", type=int, default=None)
    args = parser.parse_args(argv)
    seq = args.seq or (128 if args.tiny else 1024)
    steps = args.steps or (10 if args.tiny else 24)
    backend = "eager" if args.tiny else "inductor"
    rows = [
        run_on_ranks(measure, 1, bucketed, seq, steps, args.device, backend, timeout_s=900)[0]
        for bucketed in (False, True)
    ]
    for r in rows:
        print(
            f"{'bucketed' if r['bucketed'] else 'rounded to 8'}: {r['distinct_widths']} widths "
            f"{sorted(set(r['widths']))}, {r['compiled_frames']} compilations ({r['unique_graphs']} graphs)"
        )
    write_json("dynamic_widths", {"device": args.device, "backend": backend, "seq": seq, "rows": rows})
    plain, bucketed = rows
    ok = all(r["compiled_frames"] <= len(bucketed["buckets"]) + 1 for r in rows)
    print(
        f"HEADLINE: {plain['distinct_widths']} widths -> {bucketed['distinct_widths']} buckets; compilations "
        f"{plain['compiled_frames']} unbucketed, {bucketed['compiled_frames']} bucketed"
        + ("" if ok else " (more than one per bucket + 1: FAIL)")
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
