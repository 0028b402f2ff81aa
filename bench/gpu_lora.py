"""LoRA vs full fine-tuning on one GPU (Llama-3.2-1B shape, random init, bf16 compute): step time,
tokens/s, peak memory and losses, next to the planner's prediction of memory and tokens/s.

LoRA r 16 on every linear (PEFT), frozen base stored in bf16, fp32 adapters, AdamW on the adapters
only; full: fp32 master weights, AdamW on everything. Both through ``Accelerator.load_model`` (a
one-rank FSDP2 mesh carries the bf16 mixed precision) and the very step ``ndparallel train`` runs
(``bench/_common.nd_step``), on the same repeated batch. A run that raises is recorded and the other
still runs; a run whose loss is not finite or does not fall fails. Exit 1 on any failure.

    python bench/gpu_lora.py --seq 2048 --batch 4 --steps 8
    python bench/gpu_lora.py --tiny          # the same code on CPU, tiny model, 3 steps
"""

from __future__ import annotations

import argparse
import gc
import math
import statistics
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402


def _run(acc, cfg, args, adapter) -> dict:
    from _common import nd_step

    cuda = acc.device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    dtype = torch.bfloat16 if adapter is not None else torch.float32
    model = acc.load_model(cfg, dtype=dtype, adapter=adapter)
    opt = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad], lr=args.lr, weight_decay=0.0, fused=cuda or None
    )
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (args.batch, args.seq + 1), generator=g)
    mb = {
        "input_ids": tokens[:, :-1].contiguous().to(acc.device),
        "shift_labels": tokens[:, 1:].contiguous().to(acc.device),
        "position_ids": torch.arange(args.seq).expand(args.batch, -1).contiguous().to(acc.device),
    }
    times, losses = [], []
    for i in range(args.steps + args.warmup):
        sync()
        t0 = time.perf_counter()
        loss = nd_step(acc, model, opt, mb)
        sync()
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
        losses.append(float(loss))
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    out = {
        "step_s": statistics.median(times),
        "times_ms": [t * 1e3 for t in times],
        "losses": losses,
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
        "trainable": trainable,
    }
    del model, opt
    gc.collect()
    return out


def _planned(args, lora_r: int) -> dict:
    from ndparallel.layout.dims import ParallelDims
    from ndparallel.plan.hardware import get_preset
    from ndparallel.plan.models import PRESETS
    from ndparallel.plan.search.evaluation import evaluate_layout
    from ndparallel.plan.search.request import PlanRequest

    model = PRESETS["tiny" if args.tiny else "llama-3.2-1b"]
    req = PlanRequest.of(
        model,
        get_preset("h200"),
        gpus=1,
        gpus_per_node=1,
        sequence_len=args.seq,
        global_batch_size=args.batch,
        micro_batch_size=args.batch,
        activation_checkpointing="off",
        lora_r=lora_r,
    )
    best = evaluate_layout(req, ParallelDims()).options[0]
    return {"mem_gib": best.memory.total / 2**30, "tokens_per_s": best.tokens_per_s_per_gpu}


def _problems(who: str, r: dict) -> list[str]:
    if "error" in r:
        return [f"{who}: {r['error']}"]
    if not all(math.isfinite(x) for x in r["losses"]):
        return [f"{who}: non-finite loss {r['losses']}"]
    if not r["losses"][-1] < r["losses"][0]:
        return [f"{who}: the loss did not fall ({r['losses'][0]:.4f} -> {r['losses'][-1]:.4f})"]
    return []


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seq", type=int, default=None, help="default 2048 (--tiny 32)")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=None, help="timed steps (default 8; --tiny 2)")
    ap.add_argument("--warmup", type=int, default=None, help="default 3 (--tiny 1)")
    ap.add_argument("--lr", type=float, default=None, help="default 1e-4 (--tiny 1e-2)")
    ap.add_argument("--tiny", action="store_true", help="tiny model on CPU: the same code, seconds")
    args = ap.parse_args(argv)
    for key, gpu, tiny in (("seq", 2048, 32), ("steps", 8, 2), ("warmup", 3, 1), ("lr", 1e-4, 1e-2)):
        if getattr(args, key) is None:
            setattr(args, key, tiny if args.tiny else gpu)
    from _common import print_table, write_json

    if not args.tiny and not torch.cuda.is_available():
        print(
            "gpu_lora: no CUDA device (--tiny runs the same code on CPU)\nHEADLINE: skipped: no CUDA device"
        )
        return 77
    from gpu_single import model_config

    from ndparallel import Accelerator, ParallelismConfig
    from ndparallel.models.adapters import lora_config

    cfg = model_config(args.tiny)
    acc = Accelerator(ParallelismConfig(), mixed_precision="bf16", device="cpu" if args.tiny else "cuda")
    results: dict[str, dict] = {}
    for who, adapter in (("lora", lora_config(r=16, alpha=32, target_linear=True)), ("full", None)):
        try:
            results[who] = _run(acc, cfg, args, adapter)
            results[who]["tokens_per_s"] = args.batch * args.seq / results[who]["step_s"]
            results[who]["planned"] = _planned(args, 16 if who == "lora" else 0)
        except Exception as exc:  # noqa: BLE001 - report and run the other
            traceback.print_exc()
            results[who] = {"error": f"{type(exc).__name__}: {exc}"[:2000]}
        write_json("gpu_lora", {"settings": vars(args), "results": results})
    rows = [
        (
            who,
            r["trainable"],
            r["step_s"] * 1e3,
            r["tokens_per_s"],
            r["peak_gib"] or "n/a",
            r["planned"]["mem_gib"],
            r["planned"]["tokens_per_s"],
            f"{r['losses'][0]:.3f} → {r['losses'][-1]:.3f}",
        )
        for who, r in results.items()
        if "error" not in r
    ]
    device = torch.cuda.get_device_name(0) if acc.device.type == "cuda" else "CPU (--tiny)"
    shape = "tiny model (the planner's 'tiny' preset)" if args.tiny else "Llama-3.2-1B shape"
    print_table(
        f"{device}: {shape}, bf16, seq {args.seq}, batch {args.batch}",
        ["run", "trainable", "step ms", "tokens/s", "peak GiB", "plan GiB", "plan tok/s", "loss"],
        rows,
    )
    fails = [p for who, r in results.items() for p in _problems(who, r)]
    for f in fails:
        print(f"FAIL {f}")
    lora, full = results.get("lora", {}), results.get("full", {})
    line = "LoRA vs full:"
    if "tokens_per_s" in lora and "tokens_per_s" in full:
        line += f" tokens/s {lora['tokens_per_s'] / full['tokens_per_s']:.2f}x"
        if lora["peak_gib"] and full["peak_gib"]:
            line += (
                f", peak {lora['peak_gib']:.1f} vs {full['peak_gib']:.1f} GiB "
                f"(planned {lora['planned']['mem_gib']:.1f} vs {full['planned']['mem_gib']:.1f})"
            )
    print(f"HEADLINE: {line}" + (f"; {len(fails)} failure(s)" if fails else ""))
    acc.end_training()
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
