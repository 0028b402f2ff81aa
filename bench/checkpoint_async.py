"""Checkpoints every N steps, synchronous vs asynchronous (``AsyncCheckpointer``), and the cost of
the per-step preemption agreement — step time, time the training thread is blocked by a save,
host memory held by the staged copy. CPU ranks (gloo, FSDP over all ranks); the same measurement
on one GPU is ``bench/gpu_checkpoint_async.py``.

Modes, interleaved on one model (``--rounds`` rounds; in each, one segment of ``--every`` AdamW
steps per mode, in turn, so that a change of machine load hits every mode alike):

* ``no saves``: the baseline;
* ``preemption check``: ``PreemptionWatch.should_stop()`` after every step (the 8-byte gloo
  all-reduce ``ndparallel train`` runs; started after one step, read after the next);
* ``sync saves``: the segment ends with ``save_step_checkpoint`` (DCP, every rank writes, marker);
* ``async saves``: the segment ends with ``AsyncCheckpointer.save_step``, then ``--every`` more
  steps run while it is written (timed apart), then the wait for it.

Reported per mode: median step time, time in the preemption check, seconds the training thread is
blocked by a save call (median, the first save apart: it also creates the writer's group and
the staging buffers; async: staging + waiting for a previous save), median step time while an
async save is written, the wait after those steps, the cost of one save to the run (sync: the
call; async: call + wait + the overlapped steps' slowdown), host memory: the bytes staged (this
rank's model + optimizer shards, exact) and the private RSS added by the first staging.

    python bench/checkpoint_async.py [--world 2] [--rounds 3] [--every 4] [--hidden 512] [--layers 8]
                                      [--out DIR]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import transformers  # noqa: E402,F401
from _common import RESULTS, machine, print_table, vm_bytes  # noqa: E402

MODES = ("no saves", "preemption check", "sync saves", "async saves")


def model_config(hidden: int, layers: int, vocab: int, tied: bool = False):
    from transformers import LlamaConfig

    cfg = LlamaConfig(
        hidden_size=hidden,
        intermediate_size=hidden * 8 // 3 // 64 * 64 or 64,
        num_hidden_layers=layers,
        num_attention_heads=max(1, hidden // 64),
        num_key_value_heads=max(1, hidden // 128),
        vocab_size=vocab,
        tie_word_embeddings=tied,
    )
    cfg._attn_implementation = "sdpa"
    cfg.use_cache = False
    return cfg


def staged_bytes(model, optimizer) -> int:
    """Bytes of this rank's model + optimizer state (what a save stages)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    total = 0
    for value in (
        *get_model_state_dict(model).values(),
        *_tensors(get_optimizer_state_dict(model, optimizer)),
    ):
        local = value.to_local() if hasattr(value, "to_local") else value
        if isinstance(local, torch.Tensor):
            total += local.numel() * local.element_size()
    return total


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v)


def run_rounds(acc, args, ckpt_root: Path) -> list[dict]:
    """``--rounds`` rounds; in each, every mode runs one segment of ``--every`` steps on the same
    model, in turn (so a change of machine load hits every mode alike). A sync segment ends with a
    save; an async one with a save, ``--every`` more steps while it is written (timed apart), and
    the wait for it. Every rank returns its timings by mode."""
    from ndparallel.checkpoint import AsyncCheckpointer, save_step_checkpoint
    from ndparallel.runtime.preemption import PreemptionWatch

    torch.manual_seed(0)
    model = acc.prepare(
        transformers.AutoModelForCausalLM.from_config(
            model_config(args.hidden, args.layers, args.vocab, args.tied)
        )
    )
    optimizer = acc.prepare(torch.optim.AdamW(model.parameters(), lr=1e-4))
    gen = torch.Generator().manual_seed(1)
    batch = lambda: _batch(acc, args.batch, args.seq, args.vocab, gen)  # noqa: E731
    _step(acc, model, optimizer, batch())  # optimizer states exist before anything is measured
    saver, watch = AsyncCheckpointer(), PreemptionWatch(timeout_s=600)
    stats = {m: {"steps": [], "blocked": [], "writing_steps": [], "waits": [], "checks": []} for m in MODES}
    step, rss = 1, {}
    for _ in range(args.rounds):
        for mode in MODES:
            st = stats[mode]
            for _ in range(args.every):
                step += 1
                st["steps"].append(_timed(acc, lambda: _step(acc, model, optimizer, batch())))
                if mode == "preemption check":
                    st["checks"].append(_timed(acc, watch.should_stop))
            if mode == "sync saves":
                st["blocked"].append(
                    _timed(
                        acc,
                        lambda step=step: save_step_checkpoint(
                            ckpt_root / "sync", step, model, optimizer, save_total_limit=1
                        ),
                    )
                )
            if mode == "async saves":
                rss.setdefault("before", vm_bytes("RssAnon:"))
                st["blocked"].append(
                    _timed(
                        acc,
                        lambda step=step: saver.save_step(
                            ckpt_root / "async", step, model, optimizer, save_total_limit=1
                        ),
                    )
                )
                for _ in range(args.every):
                    step += 1
                    st["writing_steps"].append(_timed(acc, lambda: _step(acc, model, optimizer, batch())))
                rss.setdefault("after", vm_bytes("RssAnon:"))
                st["waits"].append(_timed(acc, saver.wait))
    saver.close()
    watch.settle()
    problems = _check_and_remove(ckpt_root / "sync", acc.is_main_process)
    problems += _check_and_remove(ckpt_root / "async", acc.is_main_process)
    staged = staged_bytes(model, optimizer) / 2**20
    return [_summary(mode, stats[mode], staged, rss, problems) for mode in MODES]


def _timed(acc, fn) -> float:
    _sync(acc)
    t0 = time.perf_counter()
    fn()
    _sync(acc)
    return time.perf_counter() - t0


def _summary(mode: str, st: dict, staged_mb: float, rss: dict, problems: list[str]) -> dict:
    med = lambda xs: statistics.median(xs) if xs else None  # noqa: E731
    blocked = st["blocked"]
    out = {
        "mode": mode,
        "step_s_median": med(st["steps"]),
        "saves": len(blocked),
        # steady state: the first save also creates the writer's group and the staging buffers
        "save_blocked_s": med(blocked[1:] or blocked) or 0.0,
        "save_blocked_first_s": blocked[0] if blocked else None,
        "check_s_median": med(st["checks"]),
    }
    if mode == "async saves":
        out.update(
            writing_step_s_median=med(st["writing_steps"]),
            wait_s=med(st["waits"]),
            staged_mb=staged_mb,
            staging_rss_mb=(rss["after"] - rss["before"]) / 2**20,
        )
    if mode in ("sync saves", "async saves"):
        out["problems"] = [p for p in problems if ("async" in p) == (mode == "async saves")]
    return out


def _check_and_remove(out: Path, main: bool) -> list[str]:
    """What is wrong with the checkpoints a mode wrote (every one must be complete); then they are
    deleted (rank 0, after a barrier) so the modes never hold more than a couple on disk."""
    import torch.distributed as dist

    from ndparallel.checkpoint import list_checkpoints, validate_checkpoint

    found = list_checkpoints(out)
    problems = [] if found else [f"{out.name}: no checkpoint"]
    for _, path in found:
        problems += [f"{path.name} ({out.name}): {p}" for p in validate_checkpoint(path)]
    if dist.is_initialized():
        dist.barrier()
    if main:
        shutil.rmtree(out, ignore_errors=True)
    return problems


def _batch(acc, rows: int, seq: int, vocab: int, gen):
    ids = torch.randint(0, vocab, (rows, seq + 1), generator=gen)
    return {
        "input_ids": ids[:, :-1].to(acc.device),
        "shift_labels": ids[:, 1:].to(acc.device),
        "position_ids": torch.arange(seq).expand(rows, seq).to(acc.device),
    }


def _step(acc, model, optimizer, mb) -> None:
    from ndparallel.engine import forward_backward

    forward_backward(acc.engine, model, [mb])
    optimizer.step()
    optimizer.zero_grad()


def _sync(acc) -> None:
    if acc.device.type == "cuda":
        torch.cuda.synchronize()


def rank_main(args, ckpt_root: str) -> list[dict]:
    from ndparallel import Accelerator, ParallelismConfig

    world = int(os.environ.get("WORLD_SIZE", "1"))
    acc = Accelerator(ParallelismConfig(dp_shard_size=world), mixed_precision=args.precision)
    return run_rounds(acc, args, Path(ckpt_root))


def cost_per_save(results: list[dict], every: int) -> dict[str, float]:
    """Seconds a save costs the training run: sync = the blocked call; async = the call (staging +
    waiting for the previous save) + the slowdown of the steps it overlapped + the final wait."""
    by = {r["mode"]: r for r in results}
    base, a = by["no saves"]["step_s_median"], by["async saves"]
    return {
        "sync": by["sync saves"]["save_blocked_s"],
        "async": a["save_blocked_s"] + a["wait_s"] + every * max(0.0, a["writing_step_s_median"] - base),
    }


def report(args, results: list[dict], name: str, out: Path) -> Path:
    """Print the table (rank 0's figures) and write ``out/<name>.json``."""
    import json

    base = results[0]["step_s_median"]
    cost = cost_per_save(results, args.every)
    rows = []
    for r in results:
        rows.append(
            (
                r["mode"],
                r["step_s_median"],
                r["step_s_median"] / base,
                r["check_s_median"] * 1e3 if r["check_s_median"] is not None else "-",
                r["save_blocked_s"] if r["saves"] else "-",
                r.get("writing_step_s_median", "-"),
                r.get("wait_s", "-"),
                {"sync saves": cost["sync"], "async saves": cost["async"]}.get(r["mode"], "-"),
                r.get("staged_mb", "-"),
                r.get("staging_rss_mb", "-"),
            )
        )
    print_table(
        f"save every {args.every} steps, {args.rounds} rounds, modes interleaved ({name})",
        [
            "mode",
            "step s (median)",
            "× no saves",
            "check ms",
            "save call s",
            "step s while writing",
            "wait s",
            "cost per save s",
            "staged MB",
            "staging RSS MB",
        ],
        rows,
    )
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.json"
    path.write_text(
        json.dumps(
            {"machine": machine(), "args": vars(args), "results": results, "cost_per_save_s": cost},
            indent=2,
            default=str,
        )
    )
    print(f"wrote {path}")
    return path


def parser(**defaults) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world", type=int, default=defaults.get("world", 2))
    p.add_argument("--rounds", type=int, default=defaults.get("rounds", 3))
    p.add_argument("--every", type=int, default=defaults.get("every", 4))
    p.add_argument("--hidden", type=int, default=defaults.get("hidden", 512))
    p.add_argument("--layers", type=int, default=defaults.get("layers", 8))
    p.add_argument("--vocab", type=int, default=defaults.get("vocab", 8192))
    p.add_argument("--seq", type=int, default=defaults.get("seq", 128))
    p.add_argument("--batch", type=int, default=defaults.get("batch", 2))
    p.add_argument("--precision", default=defaults.get("precision", "no"), choices=["no", "bf16"])
    p.add_argument(
        "--tied",
        action=argparse.BooleanOptionalAction,
        default=defaults.get("tied", False),
        help="tie the embedding and the LM head",
    )
    p.add_argument("--out", type=Path, default=Path(os.environ.get("BENCH_RESULTS_DIR", RESULTS)))
    p.add_argument(
        "--ckpt-dir", type=Path, default=None, help="where checkpoints are written (default: a temp dir)"
    )
    p.add_argument("--name", default=defaults.get("name", "checkpoint_async"))
    return p


def main(argv=None) -> int:
    from ndparallel.testing import run_on_ranks

    args = parser().parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="ckpt-bench-", dir=args.ckpt_dir))
    try:
        results = run_on_ranks(rank_main, args.world, args, str(root), timeout_s=3600)[0]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    report(args, results, args.name, args.out)
    problems = [p for r in results for p in r.get("problems", [])]
    for p in problems:
        print(f"incomplete checkpoint: {p}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
