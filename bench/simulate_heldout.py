"""The planner on shapes it was not tuned on: ``ndparallel simulate`` of one rank vs the planner's
``MemoryBreakdown.allocated`` (tensor peak), and what the CPU process holds besides tensors.

    python bench/simulate_heldout.py [--out DIR] [--only NAME ...] [--steps 1]

Each case is a config.json-only model (random shards; ``simulate`` reads no weights), seq and layout
below, fp32, AdamW, micro-batch 1, rank 0 unless named. Per case: the measured tensor peak (bytes of
tensor storage alive at the step's peak + the states, ``runtime/memory_probe.py``) vs the
planner's; the peak RSS (what ``train`` logs on CPU) and its part that is no tensor. Prints a
table and writes ``simulate_heldout.json`` into ``--out`` (default ``bench/results``).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LLAMA = dict(model_type="llama", max_position_embeddings=4096, tie_word_embeddings=False)
HELDOUT_017B = dict(
    LLAMA,
    hidden_size=1024,
    intermediate_size=2816,
    num_hidden_layers=8,
    num_attention_heads=16,
    num_key_value_heads=16,
    vocab_size=32000,
)
"""The held-out 0.17B Llama of issue 50, at three worlds."""

CASES = {
    # name: (HF config, layout fields, seq, extra config lines, rank)
    "heldout-0.17b-fsdp8": (
        HELDOUT_017B,
        {"dp_shard_size": -1}, 128, [], 8, 0,
    ),
    "heldout-0.17b-fsdp64": (
        HELDOUT_017B,
        {"dp_shard_size": -1}, 128, [], 64, 0,
    ),
    "heldout-0.17b-fsdp64xtp8": (
        HELDOUT_017B,
        {"dp_shard_size": -1, "tensor_parallel_size": 8}, 128, [], 512, 0,
    ),
    "vocab64k-h256-fsdp64": (
        dict(LLAMA, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
             num_attention_heads=8, num_key_value_heads=8, vocab_size=64000),
        {"dp_shard_size": -1}, 128, [], 64, 0,
    ),
    "gqa8-h512-fsdp32xtp2": (
        dict(LLAMA, hidden_size=512, intermediate_size=1408, num_hidden_layers=4,
             num_attention_heads=16, num_key_value_heads=2, vocab_size=32000),
        {"dp_shard_size": -1, "tensor_parallel_size": 2}, 256, [], 64, 0,
    ),
    "vocab128k-h512-fsdp256xcp2xtp2": (
        dict(LLAMA, hidden_size=512, intermediate_size=1536, num_hidden_layers=2,
             num_attention_heads=8, num_key_value_heads=4, vocab_size=128256),
        {"dp_shard_size": -1, "context_parallel_size": 2, "tensor_parallel_size": 2}, 256, [], 1024, 0,
    ),
    "qwen3-tied151k-fsdp128": (
        dict(model_type="qwen3", hidden_size=256, intermediate_size=768, num_hidden_layers=2,
             num_attention_heads=8, num_key_value_heads=4, head_dim=64, vocab_size=151936,
             max_position_embeddings=4096, tie_word_embeddings=True),
        {"dp_shard_size": -1}, 128, [], 128, 0,
    ),
    "moe8x2-h256-fsdp64-ep8": (
        dict(model_type="qwen3_moe", hidden_size=256, intermediate_size=768, moe_intermediate_size=256,
             num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4, head_dim=32,
             num_experts=8, num_experts_per_tok=2, vocab_size=32000, max_position_embeddings=4096,
             tie_word_embeddings=False),
        {"dp_shard_size": -1, "expert_parallel_size": 8}, 128, [], 64, 0,
    ),
    "pp2-vocab50k-fsdp32-first": (
        dict(LLAMA, hidden_size=384, intermediate_size=1024, num_hidden_layers=4,
             num_attention_heads=6, num_key_value_heads=2, vocab_size=50304),
        {"dp_shard_size": -1, "pipeline_parallel_size": 2}, 128, ["gradient_accumulation_steps: 4"], 64, 0,
    ),
    "pp2-vocab50k-fsdp32-last": (
        dict(LLAMA, hidden_size=384, intermediate_size=1024, num_hidden_layers=4,
             num_attention_heads=6, num_key_value_heads=2, vocab_size=50304),
        {"dp_shard_size": -1, "pipeline_parallel_size": 2}, 128, ["gradient_accumulation_steps: 4"], 64, 63,
    ),
}  # fmt: skip


def _config(tmp: Path, name: str) -> Path:
    hf, layout, seq, extra, _, _ = CASES[name]
    model_dir = tmp / name / "model"
    model_dir.mkdir(parents=True, exist_ok=True)
    (model_dir / "config.json").write_text(json.dumps(hf))
    lines = [
        f"base_model: {model_dir}",
        "tokenizer: builtin:stdlib",
        "datasets:",
        "  - {path: builtin:stdlib, max_files: 40}",
        f"sequence_len: {seq}",
        "micro_batch_size: 1",
        "learning_rate: 1.0e-4",
        f"output_dir: {tmp / name / 'run'}",
        f"dataset_cache_dir: {tmp / 'cache'}",
        *extra,
        *(f"{k}: {v}" for k, v in layout.items()),
    ]
    path = tmp / name / "cfg.yaml"
    path.write_text("\n".join(lines) + "\n")
    return path


def run_case(tmp: Path, name: str, steps: int) -> dict:
    *_, world, rank = CASES[name]
    cmd = [sys.executable, "-m", "ndparallel", "simulate", str(_config(tmp, name))]
    cmd += ["--world-size", str(world), "--rank", str(rank), "--steps", str(steps), "--json"]
    t0 = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    wall = time.perf_counter() - t0
    if out.returncode != 0:
        return {"case": name, "error": out.stderr.strip().splitlines()[-1:] or [f"exit {out.returncode}"]}
    r = json.loads(out.stdout)
    m, p = r["measured"], r["predicted"]
    if not p.get("tensor_peak_gib"):
        return {"case": name, "error": [p.get("why", "no prediction")], "wall_s": wall}
    return {
        "case": name,
        "layout": r["layout"]["describe"],
        "world": world,
        "rank": rank,
        "tensor_peak_mib": m["tensor_peak_gib"] * 1024,
        "predicted_mib": p["tensor_peak_gib"] * 1024,
        "error": p["error"]["tensor_peak"],
        "peak_phase": p.get("peak_phase"),
        "peak_rss_gib": m["peak_memory_gib"],
        "non_tensor_rss_gib": m["peak_memory_gib"] - m["tensor_peak_gib"],
        "rss_before_setup_gib": m.get("runtime_rss_gib"),
        "wall_s": wall,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    ap.add_argument("--only", nargs="+", choices=sorted(CASES), default=list(CASES))
    ap.add_argument("--steps", type=int, default=1)
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.only:
            rows.append(run_case(Path(tmp), name, args.steps))
            r = rows[-1]
            if isinstance(r.get("error"), list):
                print(f"{name}: FAILED: {r['error']}", flush=True)
                continue
            print(
                f"| {name} | {r['layout']} | {r['world']} | {r['rank']} | {r['tensor_peak_mib']:.1f} | "
                f"{r['predicted_mib']:.1f} | {r['error']:+.1%} | {r['peak_rss_gib']:.2f} | "
                f"{r['non_tensor_rss_gib']:.2f} | {r['wall_s']:.0f} |",
                flush=True,
            )
            out = Path(args.out)
            out.mkdir(parents=True, exist_ok=True)
            (out / "simulate_heldout.json").write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
