"""Checkpoints on one GPU, synchronous vs asynchronous (a step of ``bench/gpu_all.sh``): the same
modes as ``bench/checkpoint_async.py`` (no saves / preemption check / sync saves / async saves,
every ``--every`` steps), on CUDA: bf16 compute, fp32 master weights, AdamW, Llama-3.2-1B widths
(tied embeddings) with ``--layers`` decoder layers (8: ~0.6B parameters, ~7.4 GB of fp32 weights +
AdamW state per save; at most ~22 GB on disk at once), sequence 2048 × 2; two rounds of every
mode, a save every 6 steps; about 1.5 minutes on an H200 with a local NVMe disk (estimated).
Async saves stage into pinned host memory on a side stream (the copy overlaps the next forward and
backward; the optimizer step waits for it) and DCP writes from a background thread.

Checks (exit 1 when one fails): every checkpoint written is complete (``COMPLETE`` marker, sizes,
hashes), and an async save blocks the training thread less than a sync one. Prints the table,
writes JSON to ``--out`` (default ``$BENCH_RESULTS_DIR`` or ``bench/results``) and a last line
``HEADLINE: ...``. Exit 77 (skip) without a GPU unless ``--tiny`` (the same logic on CPU, tiny
model: what ``bench/gpu_all.sh --cpu-smoke`` runs, step ``checkpoint_async``).

    python bench/gpu_checkpoint_async.py [--layers 8] [--steps 18] [--every 6] [--ckpt-dir DIR]
    python bench/gpu_checkpoint_async.py --tiny
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from checkpoint_async import cost_per_save, parser, rank_main, report  # noqa: E402

SKIP = 77


def main(argv=None) -> int:
    p = parser(
        world=1,
        rounds=2,
        every=6,
        hidden=2048,
        layers=8,
        vocab=128256,
        seq=2048,
        batch=2,
        precision="bf16",
        tied=True,
        name="gpu_checkpoint_async",
    )
    p.add_argument("--tiny", action="store_true", help="tiny model on CPU (the logic, not the figures)")
    args = p.parse_args(argv)
    if args.tiny:
        args.hidden, args.layers, args.vocab, args.seq, args.rounds, args.every = 128, 2, 1024, 32, 1, 2
        args.precision, args.name = "no", args.name + "_tiny"
        os.environ["NDPARALLEL_DEVICE"] = "cpu"
    elif not torch.cuda.is_available():
        print("HEADLINE: skipped: no CUDA GPU (use --tiny for the CPU form)")
        return SKIP
    root = Path(tempfile.mkdtemp(prefix="ckpt-bench-", dir=args.ckpt_dir))
    try:
        results = _run(args, root)
        problems = [p for r in results for p in r.get("problems", [])]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    report(args, results, args.name, args.out)
    by = {r["mode"]: r for r in results}
    cost = cost_per_save(results, args.every)
    if not args.tiny and cost["async"] >= cost["sync"]:
        problems.append(f"an async save cost {cost['async']:.2f} s, a sync one {cost['sync']:.2f} s")
    check = by["preemption check"]
    print(
        f"HEADLINE: a save costs {cost['sync']:.2f} s sync vs {cost['async']:.2f} s async "
        f"(blocked {by['async saves']['save_blocked_s']:.2f} s); {by['async saves']['staged_mb'] / 1024:.2f} "
        f"GB "
        f"staged in host memory; preemption check {check['check_s_median'] * 1e3:.2f} ms/step, step "
        f"x{check['step_s_median'] / by['no saves']['step_s_median']:.3f}"
        + (f"; FAIL: {'; '.join(problems)}" if problems else "")
    )
    return 1 if problems else 0


def _run(args, root: Path) -> list[dict]:
    """One process (world 1), a fresh process group for the run."""
    from ndparallel.runtime.distributed import shutdown

    try:
        return rank_main(args, str(root))
    finally:
        shutdown()


if __name__ == "__main__":
    sys.exit(main())
