"""Measure what the planner predicts, on one GPU: peak memory by phase, step time and where the
time goes (kernel classes), for Llama shapes under ndparallel's own training step.

    python bench/plan_gpu_check.py [--out results.json] [--configs 1b-mb4,1b-mb4-ac,...]
    python bench/plan_gpu_check.py --tiny      # the same code on CPU with the tiny model (smoke test)

Per config: a fresh model (random init, fp32 master weights, bf16 compute through FSDP2 on a
1-rank mesh, exactly ``ndparallel train``'s path), AdamW (fused on CUDA), global token count +
``causal_lm_loss`` + backward + clip + step (``bench/_common.nd_step``). Memory: the peak of
``torch.cuda.max_memory_allocated`` in each phase (model forward, loss forward, loss backward up to
the logits' gradient, the layers' backward, clipping, optimizer step), ``max_memory_reserved``,
and the device memory the CUDA context + libraries take (``mem_get_info`` minus reserved). Time:
median of ``--steps`` steps after ``--warmup``. One profiled step: device time by kernel class
(GEMM, attention, NCCL, element-wise/other) and the top kernels. Writes JSON; the comparison with
the planner is ``python bench/plan_validation.py --gpu-results FILE``.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

SHAPES = {  # name: HF config fields (the planner's presets)
    "1b": dict(
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        vocab_size=128256,
        tie_word_embeddings=True,
    ),
    "3b": dict(
        hidden_size=3072,
        intermediate_size=8192,
        num_hidden_layers=28,
        num_attention_heads=24,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=128256,
        tie_word_embeddings=True,
    ),
    "tiny": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=256,
        tie_word_embeddings=False,
    ),
}
CONFIGS = {  # name: (shape, seq, micro-batch, activation checkpointing, planner preset)
    "1b-mb4": ("1b", 2048, 4, False, "llama-3.2-1b"),
    "1b-mb4-foreach": ("1b", 2048, 4, False, "llama-3.2-1b"),  # AdamW foreach (train's default)
    "1b-mb4-ac": ("1b", 2048, 4, True, "llama-3.2-1b"),
    "1b-s8k-mb1": ("1b", 8192, 1, False, "llama-3.2-1b"),
    "1b-mb8-ac": ("1b", 2048, 8, True, "llama-3.2-1b"),
    "3b-mb2": ("3b", 2048, 2, False, "llama-3.2-3b"),
    "tiny": ("tiny", 64, 2, False, "tiny"),
    "tiny-ac": ("tiny", 64, 2, True, "tiny"),
}
KERNEL_CLASSES = (
    ("attention", ("flash", "fmha", "attention", "attn")),
    ("gemm", ("gemm", "cutlass", "nvjet", "xmma", "cublas", "sm90_", "sm80_", "wgmma", "matmul")),
    ("nccl", ("nccl",)),
)


def kernel_class(name: str) -> str:
    low = name.lower()
    for cls, keys in KERNEL_CLASSES:
        if any(k in low for k in keys):
            return cls
    return "elementwise/other"


def build(shape: str, ac: bool, device: str, fused: bool):
    from transformers import AutoModelForCausalLM, LlamaConfig

    from ndparallel import Accelerator, ParallelismConfig
    from ndparallel.parallel.options import ActivationOptions

    cfg = LlamaConfig(max_position_embeddings=8192, **SHAPES[shape])
    cfg._attn_implementation = "sdpa"
    acc = Accelerator(
        ParallelismConfig(),
        mixed_precision="bf16",
        device=device,
        activation_options=ActivationOptions(activation_checkpointing=ac),
    )
    torch.manual_seed(0)
    with torch.device(acc.device):
        model = AutoModelForCausalLM.from_config(cfg).float()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=fused)
    model, opt = acc.prepare(model, opt)
    return acc, model, opt, cfg


class Mem:
    """Phase peaks of the CUDA caching allocator (all zeros on CPU)."""

    def __init__(self, device: str):
        self.cuda = device == "cuda"
        self.peaks: dict[str, float] = {}

    def start(self) -> None:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()

    def mark(self, phase: str) -> None:
        if self.cuda:
            self.peaks[phase] = torch.cuda.max_memory_allocated() / 2**30
            self.peaks[phase + "_end"] = torch.cuda.memory_allocated() / 2**30
            torch.cuda.reset_peak_memory_stats()


def instrumented_step(acc, model, opt, mb, mem: Mem) -> None:
    """One step split into phases, each with its own allocator peak."""
    n = acc.global_num_items([mb])
    mem.start()
    logits = model(input_ids=mb["input_ids"], position_ids=mb["position_ids"]).logits
    mem.mark("model_forward")
    loss = acc.causal_lm_loss(logits, mb["shift_labels"], n)
    mem.mark("loss_forward")
    logits.register_hook(lambda g: mem.mark("loss_backward"))
    acc.backward(loss, num_items_in_batch=n)
    mem.mark("layers_backward")
    del logits, loss
    acc.clip_grad_norm_(model.parameters(), 1.0)
    mem.mark("clip")
    opt.step()
    mem.mark("optimizer_step")
    opt.zero_grad()


def profile_step(acc, model, opt, mb, device: str) -> dict:
    from _common import nd_step
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=acts) as prof:
        nd_step(acc, model, opt, mb)
        if device == "cuda":
            torch.cuda.synchronize()
    if device != "cuda":
        return {}
    by_class: dict[str, float] = {}
    counts: dict[str, int] = {}
    kernels: dict[str, list] = {}
    for ev in prof.events():
        # Kernels and memcpy/memset only: GPU-side user annotations (FSDP::..., Optimizer.step)
        # span other kernels and would count them twice.
        if ev.device_type.name != "CUDA" or _is_annotation(ev.name):
            continue
        ms = ev.device_time / 1e3
        cls = kernel_class(ev.name)
        by_class[cls] = by_class.get(cls, 0.0) + ms
        counts[cls] = counts.get(cls, 0) + 1
        row = kernels.setdefault(ev.name[:160], [0.0, 0])
        row[0] += ms
        row[1] += 1
    top = sorted(([k, v[0], v[1]] for k, v in kernels.items()), key=lambda r: -r[1])[:80]
    ops = prof.key_averages(group_by_input_shape=True)
    op_rows = sorted(
        (
            [e.key, str(e.input_shapes)[:160], e.self_device_time_total / 1e3, e.count]
            for e in ops
            if e.self_device_time_total > 50
        ),
        key=lambda r: -r[2],
    )
    return {
        "device_ms_by_class": by_class,
        "kernels_by_class": counts,
        "top_kernels_ms_calls": top,
        "ops_self_device_ms": op_rows[:150],
    }


def _is_annotation(name: str) -> bool:
    """record_function ranges the profiler also reports on the GPU timeline (not kernels)."""
    return name.startswith(
        ("FSDP::", "Optimizer.", "ProfilerStep", "## ", "autograd::", "aten::", "PythonSubclass")
    )


def run_config(name: str, steps: int, warmup: int, device: str) -> dict:
    from _common import nd_step

    shape, seq, mbs, ac, preset = CONFIGS[name]
    fused = device == "cuda" and not name.endswith("foreach")
    acc, model, opt, cfg = build(shape, ac, device, fused)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (mbs, seq + 1), generator=g)
    mb = {
        "input_ids": tokens[:, :-1].to(acc.device),
        "shift_labels": tokens[:, 1:].to(acc.device),
        "position_ids": torch.arange(seq).expand(mbs, -1).contiguous().to(acc.device),
    }
    times = []
    for i in range(warmup + steps):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        nd_step(acc, model, opt, mb)
        if device == "cuda":
            torch.cuda.synchronize()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    mem = Mem(device)
    instrumented_step(acc, model, opt, mb, mem)
    out = {
        "config": name,
        "planner_model": preset,
        "seq": seq,
        "micro_batch": mbs,
        "checkpointing": ac,
        "fused_adamw": fused,
        "step_s": statistics.median(times),
        "step_s_all": times,
        "tokens_per_s": mbs * seq / statistics.median(times),
        "peaks_gib": mem.peaks,
    }
    if device == "cuda":
        free, total = torch.cuda.mem_get_info()
        out["max_allocated_gib"] = max(v for k, v in mem.peaks.items() if not k.endswith("_end"))
        out["max_reserved_gib"] = torch.cuda.max_memory_reserved() / 2**30
        out["reserved_now_gib"] = torch.cuda.memory_reserved() / 2**30
        out["outside_allocator_gib"] = (total - free - torch.cuda.memory_reserved()) / 2**30
    try:
        out["profile"] = profile_step(acc, model, opt, mb, device)
    except Exception as exc:  # noqa: BLE001 - the profile is a bonus; keep the row
        out["profile"] = {"error": f"{type(exc).__name__}: {exc}"}
    del model, opt, acc, mb
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--configs", default="1b-mb4,1b-mb4-ac,1b-mb4-foreach,1b-s8k-mb1,1b-mb8-ac,3b-mb2")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--tiny", action="store_true", help="CPU smoke test with the tiny model")
    ap.add_argument(
        "--out",
        default=None,
        help="JSON file (default plan_gpu_check.json in bench/results/ or $BENCH_RESULTS_DIR)",
    )
    args = ap.parse_args(argv)
    from _common import results_dir

    args.out = args.out or str(results_dir() / "plan_gpu_check.json")
    # no RANK / WORLD_SIZE: the Accelerator starts a one-rank group on an in-memory store (no port)
    device = "cpu" if args.tiny or not torch.cuda.is_available() else "cuda"
    names = ["tiny", "tiny-ac"] if device == "cpu" else args.configs.split(",")
    rows = []
    meta = {
        "device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu",
        "torch": torch.__version__,
    }
    for name in names:
        try:
            row = run_config(name, args.steps, args.warmup, device)
        except Exception as exc:  # noqa: BLE001 - report and go on with the next config
            row = {"config": name, "error": f"{type(exc).__name__}: {exc}"}
            gc.collect()
            if device == "cuda":
                torch.cuda.empty_cache()
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "profile"}), flush=True)
        if row.get("profile"):
            print(json.dumps(row["profile"].get("device_ms_by_class", row["profile"])), flush=True)
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({**meta, "rows": rows}, indent=1))
    errors = [r for r in rows if "error" in r]
    for r in errors:
        print(f"FAIL {r['config']}: {r['error']}")
    print(
        "HEADLINE: "
        + "; ".join(
            f"{r['config']} ERROR"
            if "error" in r
            else f"{r['config']} {r['tokens_per_s']:,.0f} tok/s"
            + (f", {r['max_allocated_gib']:.2f} GiB" if "max_allocated_gib" in r else "")
            for r in rows
        )
        + f"; compare: python bench/plan_validation.py --gpu-results {args.out}"
    )
    return 1 if errors else 0


if __name__ == "__main__":
    raise SystemExit(main())
