"""Training tokens/s vs world size for each strategy on this machine (shape, not absolute: the
ranks share this machine's cores, so on 2 cores throughput cannot grow past world 2).

Weak scaling for data-parallel layouts (2 rows of ``--seq`` tokens per dp rank); TP and CP
split the same 2 rows. Median of the timed steps after one warm-up, 1 thread per rank.

    python bench/scaling.py --worlds 1,2,4 --steps 4 --seq 256
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import transformers  # noqa: E402,F401
from _common import local_micro_batch, nd_step, print_table, write_json  # noqa: E402

from ndparallel.testing import run_on_ranks  # noqa: E402

STRATEGIES = {  # name -> world -> ParallelismConfig kwargs (None: not applicable)
    "DP": lambda w: {"dp_replicate_size": w},
    "FSDP": lambda w: {"dp_shard_size": w},
    "TP": lambda w: {"tp_size": w} if w <= 2 else None,  # tiny-llama has 2 KV heads
    "CP ring": lambda w: {"cp_size": w},
}


def _run(layout, seq, rows_per_dp, steps):
    import torch.distributed as dist

    from ndparallel import Accelerator, ParallelismConfig
    from ndparallel.models.presets import preset_config
    from ndparallel.tools.equivalence import (
        TrainSetup,
        build_model,
        make_global_batches,
        setup_optimizer,
    )

    acc = Accelerator(ParallelismConfig(**layout))
    setup = TrainSetup(
        preset_config("tiny-llama"),
        steps=steps + 1,
        global_micro_batch=rows_per_dp * acc.dp_size,
        seq_len=seq,
    )
    model = build_model(setup)
    opt = setup_optimizer(setup, model.parameters())
    model, opt = acc.prepare(model, opt)
    times = []
    for i, micro in enumerate(make_global_batches(setup)):
        mb = local_micro_batch(acc, micro[0])
        dist.barrier()
        t0 = time.perf_counter()
        nd_step(acc, model, opt, mb)
        dist.barrier()
        if i:
            times.append(time.perf_counter() - t0)
    return {"step_s": statistics.median(times), "tokens": setup.global_micro_batch * seq}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worlds", default="1,2,4")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--rows", type=int, default=2, help="rows per dp rank")
    args = ap.parse_args(argv)
    worlds = [int(w) for w in args.worlds.split(",")]
    results, rows = {}, []
    base = None
    for name, make in STRATEGIES.items():
        for w in worlds:
            layout = make(w) if w > 1 else {}
            if layout is None:
                continue
            if w == 1 and base is not None:
                results[f"{name}/1"] = base
                continue
            try:
                r = run_on_ranks(_run, w, layout, args.seq, args.rows, args.steps, timeout_s=600)[0]
            except Exception as exc:
                print(f"{name} world {w}: failed: {str(exc).splitlines()[:3]}")
                continue
            r["tokens_per_s"] = r["tokens"] / r["step_s"]
            results[f"{name}/{w}"] = r
            if w == 1:
                base = r
    one = results.get("DP/1") or base
    for key, r in results.items():
        name, w = key.split("/")
        rows.append(
            (
                name,
                int(w),
                r["step_s"] * 1e3,
                r["tokens"],
                r["tokens_per_s"],
                r["tokens_per_s"] / one["tokens_per_s"] if one else float("nan"),
            )
        )
    print_table(
        f"tokens/s vs world (tiny-llama fp32, seq {args.seq}, {args.rows} rows per dp rank, "
        f"{torch.get_num_threads()} threads here, 1 per rank)",
        ["strategy", "world", "step ms", "tokens/step", "tokens/s", "vs 1 rank"],
        rows,
    )
    print(f"wrote {write_json('scaling', {'settings': vars(args), 'results': results})}")


if __name__ == "__main__":
    main()
