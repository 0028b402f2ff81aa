"""The prepared single-GPU benchmark (one command, < 8 min on an H100/H200): ndparallel's speed
options one by one against a plain Hugging Face Accelerate loop, same model, batch and optimizer.

Model: Llama-3.2-1B shape (hidden 2048, 16 layers, 32/8 heads, vocab 128,256, tied), random init,
bf16 compute with fp32 master weights, fused AdamW, clipping at 1.0. Rows, at each sequence length:

* ``accelerate``: ``accelerate.Accelerator(mixed_precision="bf16")``, ``model(..., labels).loss``;
* ``nd bf16``: ndparallel, logits loss (``LossOptions(chunked=False)``), eager;
* ``nd + chunked loss``: the loss without full logits;
* ``nd + compile``: + regional ``torch.compile`` of the decoder layers;
* ``nd + fp8``: + torchao float8 linears (tensorwise), on GPUs of compute capability >= 8.9 with
  torchao installed; otherwise the row says why it was skipped.

Reported: median step time, tokens/s, MFU = (6 N + 12 L h s) × tokens/s / the GPU's dense bf16
peak (also for the fp8 row, so rows compare), peak memory allocated. ``--tiny`` runs the same
logic on CPU with a tiny model (what ``tests/test_bench_gpu_single.py`` does).

    python bench/gpu_single.py                       # seq 2048 × 4 and 8192 × 1 (default)
    python bench/gpu_single.py --seqs 2048 --steps 20
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

PEAK_BF16 = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10G": 70e12}
VARIANTS = ("accelerate", "nd bf16", "nd + chunked loss", "nd + compile", "nd + fp8")


def model_config(tiny: bool):
    from transformers import LlamaConfig

    if tiny:
        cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, vocab_size=1024, tie_word_embeddings=True)
    else:
        cfg = LlamaConfig(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                          num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                          vocab_size=128256, tie_word_embeddings=True, max_position_embeddings=8192)
    cfg._attn_implementation = "sdpa"
    cfg.use_cache = False
    return cfg


def build(cfg, device):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    with torch.device(device):
        return AutoModelForCausalLM.from_config(cfg).float()


def batch(cfg, rows: int, seq: int, device) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (rows, seq + 1), generator=g)
    return {"input_ids": tokens[:, :-1].to(device), "shift_labels": tokens[:, 1:].to(device),
            "position_ids": torch.arange(seq).expand(rows, -1).to(device)}


def fp8_skip_reason(device: torch.device) -> str | None:
    from ndparallel.parallel.float8 import float8_problem
    from ndparallel.parallel.options import Float8Options

    return float8_problem(Float8Options(enabled=True), device.type)


def accelerate_runner(cfg, device, tiny: bool):
    """Hugging Face Accelerate's plain loop: the model's own loss, fused AdamW where supported."""
    from accelerate import Accelerator

    acc = Accelerator(mixed_precision="no" if tiny else "bf16", cpu=device.type == "cpu")
    model = build(cfg, device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    model, opt = acc.prepare(model, opt)

    def step(mb):
        loss = model(input_ids=mb["input_ids"], position_ids=mb["position_ids"], labels=mb["input_ids"]).loss
        acc.backward(loss)
        acc.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
    return step


def nd_runner(cfg, device, tiny: bool, chunked: bool, compile_backend: str | None, fp8: bool):
    from _common import nd_step

    from ndparallel import Accelerator, ParallelismConfig
    from ndparallel.parallel.float8 import precompute_scales
    from ndparallel.parallel.options import CompileOptions, Float8Options, LossOptions
    from ndparallel.training.optim import build_optimizer

    f8 = Float8Options(enabled=fp8)
    acc = Accelerator(ParallelismConfig(), mixed_precision="no" if tiny else "bf16", device=device.type,
                      loss_options=LossOptions(chunked=chunked),
                      compile_options=CompileOptions(enabled=compile_backend is not None,
                                                     backend=compile_backend or "inductor"),
                      float8_options=f8)
    model = acc.prepare(build(cfg, device))
    opt = build_optimizer(model.parameters(), lr=1e-4)

    def step(mb):
        nd_step(acc, model, opt, {k: v.clone() for k, v in mb.items()})
        precompute_scales(model, f8) if fp8 else None
    return step


def measure(step, mb, steps: int, warmup: int, device) -> tuple[list[float], float]:
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = []
    for i in range(warmup + steps):
        sync()
        t0 = time.perf_counter()
        step(mb)
        sync()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else float("nan")
    return times, peak


def run_variant(name, cfg, device, args, mb):
    if name == "nd + fp8" and (reason := fp8_skip_reason(device)):
        return {"skipped": reason}
    compile_backend = args.compile_backend if name in ("nd + compile", "nd + fp8") else None
    if name == "accelerate":
        step = accelerate_runner(cfg, device, args.tiny)
    else:
        step = nd_runner(cfg, device, args.tiny, chunked=name != "nd bf16", compile_backend=compile_backend,
                         fp8=name == "nd + fp8")
    times, peak = measure(step, mb, args.steps, args.warmup, device)
    del step
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {"step_s": statistics.median(times), "peak_gib": peak}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seqs", default="2048,8192", help="sequence lengths; rows = --tokens / seq")
    ap.add_argument("--tokens", type=int, default=8192, help="tokens per step")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--compile-backend", default="inductor")
    ap.add_argument("--tiny", action="store_true", help="tiny model on CPU: checks the logic")
    ap.add_argument("--name", default="gpu_single", help="results file: bench/results/NAME.json")
    args = ap.parse_args(argv)
    from _common import print_table, write_json

    if args.tiny:
        args.seqs = args.seqs if args.seqs != ap.get_default("seqs") else "32,64"
        args.tokens, args.steps, args.warmup = 128, 2, 1
        args.compile_backend = "aot_eager" if args.compile_backend == "inductor" else args.compile_backend
    elif not torch.cuda.is_available():
        print("gpu_single: skipped (no CUDA device; --tiny runs the logic on CPU)")
        write_json("gpu_single", {"skipped": "no CUDA device"})
        return
    device = torch.device("cpu" if args.tiny else "cuda")
    cfg = model_config(args.tiny)
    name = torch.cuda.get_device_name(0) if device.type == "cuda" else "CPU (--tiny)"
    peak = next((v for k, v in PEAK_BF16.items() if k in name), None)
    n_matmul = _matmul_params(cfg)
    results = {}
    for seq in (int(s) for s in args.seqs.split(",")):
        rows_per_step = max(1, args.tokens // seq)
        mb = batch(cfg, rows_per_step, seq, device)
        flops_per_token = 6 * n_matmul + 12 * cfg.num_hidden_layers * cfg.hidden_size * seq
        rows, results[seq] = [], {}
        for variant in args.variants.split(","):
            r = run_variant(variant, cfg, device, args, mb)
            results[seq][variant] = r
            if "skipped" in r:
                rows.append((variant, "skipped", "", "", "", ""))
                continue
            r["tokens_per_s"] = rows_per_step * seq / r["step_s"]
            r["mfu"] = flops_per_token * r["tokens_per_s"] / peak if peak else None
            base = results[seq].get("accelerate", {}).get("tokens_per_s")
            r["vs_accelerate"] = r["tokens_per_s"] / base if base else None
            rows.append((variant, r["step_s"] * 1e3, r["tokens_per_s"],
                         f"{r['mfu']:.1%}" if r["mfu"] else "n/a", r["peak_gib"],
                         f"{r['vs_accelerate']:.2f}x" if r["vs_accelerate"] else ""))
        print_table(f"{name}: {n_matmul / 1e9:.2f}B matmul params, seq {seq} × {rows_per_step}, "
                    f"median of {args.steps} steps", ["loop", "step ms", "tokens/s", "MFU", "peak GiB",
                                                      "vs accelerate"], rows)
        for variant, r in results[seq].items():
            if "skipped" in r:
                print(f"{variant}: skipped: {r['skipped']}")
    path = write_json(args.name, {"settings": vars(args), "device": name, "results": results,
                                     "n_matmul_params": n_matmul})
    print(f"wrote {path}")


def _matmul_params(cfg) -> int:
    h, L, i = cfg.hidden_size, cfg.num_hidden_layers, cfg.intermediate_size
    kv = cfg.num_key_value_heads * (getattr(cfg, "head_dim", None) or h // cfg.num_attention_heads)
    q = cfg.num_attention_heads * (getattr(cfg, "head_dim", None) or h // cfg.num_attention_heads)
    return L * (h * q + 2 * h * kv + q * h + 3 * h * i) + cfg.vocab_size * h


if __name__ == "__main__":
    main()
