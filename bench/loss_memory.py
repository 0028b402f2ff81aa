"""Peak host memory of one training step with a large vocabulary: the chunked loss vs the logits.

A tiny Llama (hidden 64, 2 layers) with a 131,072-token vocabulary trains one AdamW step on 8,192
tokens (4 rows × 2,048) on one CPU process, once with the chunked loss (default) and once with
the full logits (``LossOptions(chunked=False)``). Each run is a freshly forked process; peak =
VmHWM (the kernel's high-water mark of resident memory) at the end of the step, and its increase
over the RSS before the step. Full fp32 logits here are 8,192 × 131,072 × 4 B = 4.3 GB per copy.

    python bench/loss_memory.py                    # both (the logits run needs ~17 GB free)
    python bench/loss_memory.py --skip-logits      # chunked only
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import transformers  # noqa: E402,F401
from _common import print_table, write_json  # noqa: E402

from ndparallel.testing import run_on_ranks  # noqa: E402

GB = 1e9


def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(field)


def _one_step(chunked: bool, vocab: int, rows: int, seq: int) -> dict:
    import time

    from ndparallel import Accelerator, ParallelismConfig
    from ndparallel.engine import forward_backward
    from ndparallel.models.presets import preset_config
    from ndparallel.techniques.technique_options import LossOptions
    from ndparallel.tools.equivalence import (
        TrainSetup,
        build_model,
        make_global_batches,
    )

    setup = TrainSetup(
        preset_config("tiny-llama", vocab_size=vocab), steps=1, global_micro_batch=rows, seq_len=seq
    )
    acc = Accelerator(ParallelismConfig(), loss_options=LossOptions(chunked=chunked))
    model = acc.prepare(build_model(setup))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch = make_global_batches(setup)[0]
    base = _status_kb("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
    t = time.perf_counter()
    loss = forward_backward(acc.engine, model, batch)
    opt.step()
    seconds = time.perf_counter() - t
    peak = _status_kb("VmHWM")
    return {
        "peak_rss": peak * 1024,
        "increase": (peak - base) * 1024,
        "loss": float(loss),
        "seconds": seconds,
    }


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--vocab", type=int, default=131072)
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--skip-logits", action="store_true", help="skip the full-logits run (~17 GB)")
    args = ap.parse_args(argv)
    cases = [("chunked loss", True)] + ([] if args.skip_logits else [("full logits", False)])
    results, rows = {}, []
    for label, chunked in cases:
        r = run_on_ranks(_one_step, 1, chunked, args.vocab, args.rows, args.seq, timeout_s=1200)[0]
        results[label] = r
        rows.append((label, r["peak_rss"] / GB, r["increase"] / GB, r["seconds"], r["loss"]))
    print_table(
        f"one AdamW step, tiny Llama, vocab {args.vocab:,}, {args.rows * args.seq:,} tokens, 1 CPU process",
        ["loss", "peak RSS GB", "step increase GB", "step s", "loss value"],
        rows,
    )
    goal = results["chunked loss"]["peak_rss"] <= 2.0 * GB
    print(f"goal: chunked peak RSS <= 2.0 GB: {'met' if goal else 'NOT met'}")
    path = write_json("loss_memory", {"settings": vars(args), "results": results, "goal_met": goal})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
