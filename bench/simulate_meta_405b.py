"""Meta's Llama-3.1-405B layout against ``ndparallel simulate`` of its first pipeline rank (issue 50).

    nice -n 10 python bench/simulate_meta_405b.py [--no-offload] [--seq 1024] [--out DIR]

Meta's layout and settings as ndparallel runs them — PP 16 (Interleaved1F1B, 7 stages per rank) ×
FSDP 64 without resharding after forward × TP 8 with sequence parallel, world 8,192, micro-batch 1,
32 micro-batches per step (2,048 sequences), gradients reduced once per step, bf16, AdamW, selective
activation checkpointing and activation offloading — on rank 0 (the first stage, the one that
holds the most micro-batches in flight). The model is the 405B's shape shrunk in width where the
per-token ratios survive (128 query / 8 K/V heads, head dim h/128, MLP 3.25·h, at h = 1024 instead
of 16,384), 112 layers (16 × 7: one per stage, the even split ``simulate`` needs; the 405B has 126),
an 8k vocabulary (the builtin tokenizer's) and sequences of ``--seq`` tokens (8,192 at Meta's
scale; 1,024 by default, ~6 min on 2 CPU cores). Prints the measured tensor peak and offloaded host
memory beside the planner's; writes ``simulate_meta_405b[_no_offload].json``.
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
sys.path.insert(0, str(ROOT / "bench"))
from simulate_long_context import memory_row  # noqa: E402

HIDDEN = 1024
MODEL = dict(
    model_type="llama",
    hidden_size=HIDDEN,
    intermediate_size=13 * HIDDEN // 4,
    num_hidden_layers=112,
    num_attention_heads=128,
    num_key_value_heads=8,
    head_dim=HIDDEN // 128,
    vocab_size=8192,
    max_position_embeddings=8192,
    tie_word_embeddings=False,
    rms_norm_eps=1e-5,
)


def _config(tmp: Path, seq: int, offload: bool) -> Path:
    (tmp / "model").mkdir(parents=True, exist_ok=True)
    (tmp / "model" / "config.json").write_text(json.dumps(MODEL))
    lines = [
        f"base_model: {tmp / 'model'}",
        "tokenizer: builtin:stdlib",
        "datasets:",
        "  - {path: builtin:stdlib, max_files: 60}",
        f"sequence_len: {seq}",
        "micro_batch_size: 1",
        "gradient_accumulation_steps: 32",
        "learning_rate: 1.0e-4",
        "bf16: true",
        f"output_dir: {tmp / 'run'}",
        f"dataset_cache_dir: {tmp / 'cache'}",
        "pipeline_parallel_size: 16",
        "pipeline_schedule: Interleaved1F1B",
        "pipeline_virtual_stages: 7",
        "dp_shard_size: 64",
        "tensor_parallel_size: 8",
        "sequence_parallel: true",
        f"activation_offloading: {str(offload).lower()}",
        "fsdp_config: {activation_checkpointing: true, ac_policy: selective, reshard_after_forward: false}",
    ]
    (tmp / "cfg.yaml").write_text("\n".join(lines) + "\n")
    return tmp / "cfg.yaml"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--no-offload", action="store_true", help="selective checkpointing alone")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    args = ap.parse_args()
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        cfg = _config(Path(tmp), args.seq, not args.no_offload)
        cmd = [sys.executable, "-m", "ndparallel", "simulate", str(cfg), "--world-size", "8192"]
        out = subprocess.run([*cmd, "--rank", "0", "--steps", "1", "--json"], capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"simulate failed: {out.stderr.strip().splitlines()[-1:]}")
    row = {
        "seq": args.seq,
        "offload": not args.no_offload,
        **memory_row(json.loads(out.stdout)),
        "wall_s": time.perf_counter() - t0,
    }
    print(json.dumps(row, indent=1))
    Path(args.out).mkdir(parents=True, exist_ok=True)
    name = f"simulate_meta_405b{'_no_offload' if args.no_offload else ''}.json"
    (Path(args.out) / name).write_text(json.dumps(row, indent=2))


if __name__ == "__main__":
    main()
