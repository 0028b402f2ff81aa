"""LoRA vs full fine-tuning on one GPU (Llama-3.2-1B shape, random init, bf16 compute): step time,
tokens/s and peak memory, and the planner's prediction of both. Prints that it skipped without CUDA.

LoRA r 16 on every linear (PEFT), frozen base stored in bf16, fp32 adapters, AdamW on the adapters
only; full: fp32 master weights, AdamW on everything. Both through ``Accelerator.load_model`` (a
one-rank FSDP2 mesh carries the bf16 mixed precision) and the very step ``ndparallel train`` runs.

    python bench/gpu_lora.py --seq 2048 --batch 4 --steps 8
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402


def _run(acc, cfg, args, adapter) -> dict:
    from _common import nd_step

    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    dtype = torch.bfloat16 if adapter is not None else torch.float32
    model = acc.load_model(cfg, dtype=dtype, adapter=adapter)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4, fused=True)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (args.batch, args.seq + 1), generator=g)
    mb = {"input_ids": tokens[:, :-1].to(acc.device), "shift_labels": tokens[:, 1:].to(acc.device),
          "position_ids": torch.arange(args.seq).expand(args.batch, -1).to(acc.device)}
    times, losses = [], []
    for i in range(args.steps + args.warmup):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        losses.append(float(nd_step(acc, model, opt, mb)))
        torch.cuda.synchronize()
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    out = {"step_s": statistics.median(times), "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
           "trainable": trainable, "first_loss": losses[0], "last_loss": losses[-1]}
    del model, opt
    gc.collect()
    return out


def _planned(args, lora_r: int) -> dict:
    from ndparallel.plan.hardware import get_preset
    from ndparallel.plan.layout import Layout
    from ndparallel.plan.models import PRESETS
    from ndparallel.plan.search import PlanRequest, evaluate_layout

    req = PlanRequest(PRESETS["llama-3.2-1b"], get_preset("h200"), gpus=1, gpus_per_node=1, seq_len=args.seq,
                      global_batch=args.batch, micro_batch=args.batch, checkpointing="off", lora_r=lora_r)
    best = evaluate_layout(req, Layout()).options[0]
    return {"mem_gib": best.memory.total / 2**30, "tokens_per_s": best.tokens_per_s_per_gpu}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=3)
    args = ap.parse_args(argv)
    from _common import print_table, write_json

    if not torch.cuda.is_available():
        print("gpu_lora: skipped (no CUDA device)")
        write_json("gpu_lora", {"skipped": "no CUDA device"})
        return
    from gpu_single import llama_1b_config

    from ndparallel import Accelerator, ParallelismConfig
    from ndparallel.models.adapters import lora_config

    for k, v in (("RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29534")):
        os.environ.setdefault(k, v)
    cfg = llama_1b_config()
    acc = Accelerator(ParallelismConfig(), mixed_precision="bf16", device="cuda")
    results = {"lora": _run(acc, cfg, args, lora_config(r=16, alpha=32, target_linear=True)),
               "full": _run(acc, cfg, args, None)}
    rows = []
    for who, r in results.items():
        r["tokens_per_s"] = args.batch * args.seq / r["step_s"]
        r["planned"] = _planned(args, 16 if who == "lora" else 0)
        rows.append((who, r["trainable"], r["step_s"] * 1e3, r["tokens_per_s"], r["peak_gib"],
                     r["planned"]["mem_gib"], r["planned"]["tokens_per_s"], r["last_loss"]))
    print_table(f"{torch.cuda.get_device_name(0)}: Llama-3.2-1B shape, bf16, seq {args.seq}, batch {args.batch}",
                ["run", "trainable", "step ms", "tokens/s", "peak GiB", "plan GiB", "plan tok/s",
                 "loss"], rows)
    write_json("gpu_lora", {"settings": vars(args), "results": results})
    acc.end_training()


if __name__ == "__main__":
    main()
