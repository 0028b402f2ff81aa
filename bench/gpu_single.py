"""One GPU, one process, six training loops side by side on the same model, batch and optimizer:
Hugging Face Accelerate's loop, a plain FSDP2 loop, ndparallel eager, + chunked loss, + compile,
+ fp8 (``bench/_gpu_loops.py`` has the loops). Step 1 of ``bench/gpu_all.sh``.

Model: Llama-3.2-1B shape (hidden 2048, 16 layers, 32/8 heads, head_dim 64, vocab 128,256, tied),
random init (seed 0), fp32 master weights, bf16 compute, AdamW (lr 1e-4, no weight decay, fused on
CUDA), clip 1.0, one micro-batch of ``--tokens`` tokens per step (8,192: 2048 × 4 or 8192 × 1), the
same batch every step. Rows (each adds to the one above from ``nd eager`` on):

* ``accelerate``: ``accelerate.Accelerator(mixed_precision="bf16")``, ``model(..., labels).loss``;
* ``plain fsdp2``: ``fully_shard`` per layer + root, bf16 params / fp32 reduce, logits + cross-entropy;
* ``nd eager``: ndparallel, logits loss (``LossOptions(chunked=False)``), no compile: the reference;
* ``nd + chunked loss``: the loss without full logits;
* ``nd + compile``: + regional ``torch.compile`` of the decoder layers (inductor);
* ``nd + fp8``: + torchao float8 linears (tensorwise) on GPUs of compute capability >= 8.9; else
  the row says why it was skipped.

Per row: median step time, tokens/s, MFU, peak memory allocated, the loss of every step and the step
times. MFU = model FLOPs per token × tokens/s / the GPU's dense bf16 peak (also for the fp8 row, so
rows compare), with the project's one FLOP count (``ndparallel.models.flops``, through the planner's
``plan.compute.model_flops_per_token``): 6·N (N = matmul parameters, the LM head included) +
6·L·a·d·s, i.e. causal attention counted as it runs (QKᵀ and PV over half the score matrix,
backward twice the forward).

Correctness: every row's loss at every step must stay within ``DRIFT_TOL`` (relative) of ``nd eager``'s
(all rows train the same model on the same batch), and ``nd eager``'s loss must fall by at least
``MIN_FALL`` over the run (else the comparison could not tell a broken row from a working one). A
row that raises is recorded with its error and the next row runs; the JSON is rewritten after every
row. Exit 1 if a row failed (raised, drifted, non-finite) or the reference did not learn.

    python bench/gpu_single.py                  # seq 2048 × 4 (≈ 3 min on an H200, compile included)
    python bench/gpu_single.py --seqs 8192      # 8192 × 1
    python bench/gpu_single.py --tiny           # the same code on CPU, tiny model, 3 steps (seconds)
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

VARIANTS = ("accelerate", "plain fsdp2", "nd eager", "nd + chunked loss", "nd + compile", "nd + fp8")
REFERENCE = "nd eager"
DRIFT_TOL = {"nd + fp8": 0.05}
"""Largest relative loss difference from ``nd eager`` at any step: 2 % for the bf16 rows
(``DEFAULT_DRIFT_TOL``), 5 % for fp8 (float8 matmuls round far more than bf16)."""
DEFAULT_DRIFT_TOL = 0.02
MIN_FALL = 0.10
"""``nd eager``'s loss must fall by >= 10 % of its first value (a Llama-shaped model at lr 1e-4 on
one repeated batch falls ~25 % in 11 steps on CPU; a row whose gradients were broken stays flat)."""


def model_config(tiny: bool):
    from transformers import LlamaConfig

    if tiny:
        cfg = LlamaConfig(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=1024,
            tie_word_embeddings=True,
        )
    else:
        cfg = LlamaConfig(
            hidden_size=2048,
            intermediate_size=8192,
            num_hidden_layers=16,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=64,
            vocab_size=128256,
            tie_word_embeddings=True,
            max_position_embeddings=8192,
        )
    cfg._attn_implementation = "sdpa"
    cfg.use_cache = False
    return cfg


def batch(cfg, rows: int, seq: int, device) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (rows, seq + 1), generator=g)
    return {
        "input_ids": tokens[:, :-1].contiguous().to(device),
        "shift_labels": tokens[:, 1:].contiguous().to(device),
        "position_ids": torch.arange(seq).expand(rows, -1).contiguous().to(device),
    }


def fp8_skip_reason(device: torch.device, emulate: bool) -> str | None:
    from ndparallel.techniques.float8 import float8_problem
    from ndparallel.techniques.technique_options import Float8Options

    return float8_problem(Float8Options(enabled=True, emulate=emulate), device.type)


def make_loop(name: str, cfg, device, args):
    import _gpu_loops as loops

    if name == "accelerate":
        return loops.make_accelerate(cfg, device, args.lr)
    if name == "plain fsdp2":
        return loops.make_plain_fsdp2(cfg, device, args.lr)
    compiled = name in ("nd + compile", "nd + fp8")
    return loops.make_nd(
        cfg,
        device,
        args.lr,
        chunked=name != "nd eager",
        compile_backend=args.compile_backend if compiled else None,
        fp8=name == "nd + fp8",
        emulate_fp8=args.tiny,
    )


def run_variant(name: str, cfg, device, args, mb) -> dict:
    """Build the loop, run warm-up + timed steps; losses of all steps, times of the timed ones."""
    if name == "nd + fp8" and (reason := fp8_skip_reason(device, emulate=args.tiny)):
        return {"skipped": reason}
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    gc.collect()  # the previous row's loop is gone now: its memory must not count in this row's peak
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    start_gib = torch.cuda.memory_allocated() / 2**30 if cuda else None  # the batch, ~nothing else
    t_build = time.perf_counter()
    loop = make_loop(name, cfg, device, args)
    build_s = time.perf_counter() - t_build
    try:
        losses, times = [], []
        for i in range(args.warmup + args.steps):
            sync()
            t0 = time.perf_counter()
            loss = loop.step(mb)
            sync()
            if i >= args.warmup:
                times.append(time.perf_counter() - t0)
            losses.append(float(loss))  # after the timed region: the read-back is not measured
        peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
    finally:
        loop.close()
    return {
        "step_s": statistics.median(times),
        "times_ms": [t * 1e3 for t in times],
        "losses": losses,
        "peak_gib": peak,
        "allocated_at_start_gib": start_gib,
        "build_s": build_s,
    }


def check_drift(rows: dict) -> list[str]:
    """Set each row's ``drift`` / ``drift_ok`` against the reference; return the failures."""
    ref = rows.get(REFERENCE, {}).get("losses")
    fails = []
    if not ref:
        return [f"{REFERENCE} did not run: no loss to compare the rows with"]
    fall = (ref[0] - ref[-1]) / abs(ref[0])
    if not fall >= MIN_FALL:
        fails.append(
            f"{REFERENCE}'s loss fell {fall:.1%} (< {MIN_FALL:.0%}): the drift check cannot "
            "tell a broken row from a working one (more --steps or a larger --lr)"
        )
    for name, r in rows.items():
        if "losses" not in r:
            continue
        tol = DRIFT_TOL.get(name, DEFAULT_DRIFT_TOL)
        drift = max(abs(a - b) / abs(b) for a, b in zip(r["losses"], ref))
        finite = all(math.isfinite(x) for x in r["losses"])
        r.update(drift=drift, drift_tol=tol, drift_ok=finite and drift <= tol)
        if not r["drift_ok"]:
            fails.append(
                f"{name}: loss drifts {drift:.2%} from {REFERENCE} (tolerance {tol:.0%})"
                + ("" if finite else "; non-finite loss")
            )
    return fails


def add_rates(r: dict, tokens: int, flops_per_token: float, peak: float | None, base: dict | None) -> None:
    r["tokens_per_s"] = tokens / r["step_s"]
    r["mfu"] = flops_per_token * r["tokens_per_s"] / peak if peak else None
    ok_base = base and "tokens_per_s" in base
    r["vs_accelerate"] = r["tokens_per_s"] / base["tokens_per_s"] if ok_base else None
    both_peaks = ok_base and r["peak_gib"] and base["peak_gib"]
    r["peak_vs_accelerate"] = r["peak_gib"] / base["peak_gib"] if both_peaks else None


def row_cells(name: str, r: dict) -> tuple:
    if "skipped" in r or "error" in r:
        return (name, "skipped" if "skipped" in r else "ERROR", "", "", "", "", "", "", "")

    def pct(v):
        return f"{v:.1%}" if v is not None else "n/a"

    def ratio(v):
        return f"{v:.2f}x" if v is not None else ""

    drift = f"{r['drift']:.2%}" + ("" if r.get("drift_ok") else " FAIL") if "drift" in r else ""
    return (
        name,
        f"{r['step_s'] * 1e3:.1f}",
        f"{r['tokens_per_s']:,.0f}",
        pct(r["mfu"]),
        f"{r['peak_gib']:.2f}" if r["peak_gib"] is not None else "n/a",
        ratio(r["vs_accelerate"]),
        ratio(r["peak_vs_accelerate"]),
        f"{r['losses'][0]:.3f} → {r['losses'][-1]:.3f}",
        drift,
    )


def headline(seq: int, rows: dict, fails: list[str]) -> str:
    nd = [(r["tokens_per_s"], n) for n, r in rows.items() if n.startswith("nd") and "tokens_per_s" in r]
    text = f"seq {seq}"
    if nd:
        best = rows[max(nd)[1]]
        text += f": best {max(nd)[1]}"
        if best.get("vs_accelerate"):
            text += f" {best['vs_accelerate']:.2f}x Accelerate tok/s (goal 1.3x)"
        if best.get("mfu") is not None:
            text += f", MFU {best['mfu']:.1%} (goal 50%)"
        if best.get("peak_vs_accelerate"):
            text += f", peak {best['peak_vs_accelerate']:.2f}x Accelerate's (goal 0.6x)"
    return text + (f"; {len(fails)} failure(s)" if fails else "; all rows within the loss tolerance")


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--seqs", default=None, help="sequence lengths, comma-separated (default 2048; --tiny 32)"
    )
    ap.add_argument("--tokens", type=int, default=None, help="tokens per step (default 8192; --tiny 128)")
    ap.add_argument("--steps", type=int, default=None, help="timed steps (default 8; --tiny 2)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed first steps (default 3; --tiny 1)")
    ap.add_argument("--lr", type=float, default=None, help="AdamW learning rate (default 1e-4; --tiny 1e-2)")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--compile-backend", default=None, help="default inductor (--tiny: aot_eager)")
    ap.add_argument("--tiny", action="store_true", help="tiny model on CPU: the same code, seconds")
    ap.add_argument(
        "--name",
        default="gpu_single",
        help="results file NAME.json in $BENCH_RESULTS_DIR (default bench/results)",
    )
    args = ap.parse_args(argv)
    for key, gpu, tiny in (
        ("seqs", "2048", "32"),
        ("tokens", 8192, 128),
        ("steps", 8, 2),
        ("warmup", 3, 1),
        ("lr", 1e-4, 1e-2),
        ("compile_backend", "inductor", "aot_eager"),
    ):
        if getattr(args, key) is None:
            setattr(args, key, tiny if args.tiny else gpu)
    unknown = set(args.variants.split(",")) - set(VARIANTS)
    if unknown:
        ap.error(f"unknown --variants {sorted(unknown)}; choose from {', '.join(VARIANTS)}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    from _common import print_table, write_json

    from ndparallel.plan.models import from_hf_config
    from ndparallel.plan.time.compute import model_flops_per_token
    from ndparallel.training.metrics import device_peak_flops

    if not args.tiny and not torch.cuda.is_available():
        print(
            "gpu_single: no CUDA device (--tiny runs the same code on CPU)\nHEADLINE: skipped: no CUDA device"
        )
        return 77
    device = torch.device("cpu" if args.tiny else "cuda")
    cfg = model_config(args.tiny)
    spec = from_hf_config(cfg.to_dict(), "tiny" if args.tiny else "llama-3.2-1b")
    name = torch.cuda.get_device_name(0) if device.type == "cuda" else "CPU (--tiny)"
    peak = device_peak_flops(device, bf16=True)
    chosen = [v for v in VARIANTS if v in args.variants.split(",")]  # Accelerate first: before any group
    results, fails, lines = {}, [], []
    payload = {
        "settings": vars(args),
        "device": name,
        "peak_bf16_flops": peak,
        "results": results,
        "matmul_params": spec.matmul_params,
        "drift_tol": {v: DRIFT_TOL.get(v, DEFAULT_DRIFT_TOL) for v in VARIANTS},
        "min_fall": MIN_FALL,
    }
    for seq in (int(s) for s in args.seqs.split(",")):
        rows_per_step = max(1, args.tokens // seq)
        mb = batch(cfg, rows_per_step, seq, device)
        flops = model_flops_per_token(spec, seq)
        rows = results[seq] = {}
        for variant in chosen:
            try:
                r = run_variant(variant, cfg, device, args, mb)
            except Exception as exc:  # noqa: BLE001 - one broken row must not lose the others
                traceback.print_exc()
                r = {"error": f"{type(exc).__name__}: {exc}"[:2000]}
            rows[variant] = r
            if "step_s" in r:
                add_rates(r, rows_per_step * seq, flops, peak, rows.get("accelerate"))
            check_drift(rows)
            write_json(args.name, payload)  # after every row: a later crash loses nothing measured
            print(
                f"ROW seq {seq}: "
                + " | ".join(str(c) for c in row_cells(variant, r))
                + (f" | {r['error']}" if "error" in r else ""),
                flush=True,
            )
        seq_fails = [f"{v}: {r['error']}" for v, r in rows.items() if "error" in r] + check_drift(rows)
        fails += [f"seq {seq}: {f}" for f in seq_fails]
        write_json(args.name, payload)
        print_table(
            f"{name}: {spec.matmul_params / 1e9:.2f}B matmul params, bf16, seq {seq} × {rows_per_step}, "
            f"median of {args.steps} steps after {args.warmup}; MFU at {flops / 1e9:.2f} GFLOP/token",
            [
                "loop",
                "step ms",
                "tokens/s",
                "MFU",
                "peak GiB",
                "tok/s vs acc",
                "peak vs acc",
                "loss first → last",
                "drift",
            ],
            [row_cells(v, r) for v, r in rows.items()],
        )
        for v, r in rows.items():
            if "skipped" in r:
                print(f"{v}: skipped: {r['skipped']}")
        lines.append(headline(seq, rows, seq_fails))
    for f in fails:
        print(f"FAIL {f}")
    print("HEADLINE: " + "; ".join(lines))
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
