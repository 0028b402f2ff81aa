"""The long-context planner terms against ``ndparallel simulate`` of one CP rank (issue 50).

    nice -n 10 python bench/simulate_long_context.py [--seq 32768] [--out DIR]

Llama-3.1-8B's shape shrunk in width only where the per-token ratios survive: 32 query / 8 K/V
heads, head dim h/32, MLP 3.5·h, at h = 256 (8B: 4096), 2 layers, an 8k vocabulary (the builtin
tokenizer's), bf16, AdamW, chunked loss in 64-token chunks (so the loss is not the peak, as at
millions of tokens), and the long-context settings of ``plan --max-seq-len``'s best row: CP 8 with
Ulysses, activation checkpointing, tiled MLP, activation offloading. Rank 0 of world 8. Prints the
measured tensor peak (``runtime/memory_probe.py``) beside the planner's ``allocated`` as the
simulation reports it, and the planner's previous upper bound (the attention's buffers added to
the whole recomputed layer, ``mlp_half_saved_per_token`` = 0). Writes ``simulate_long_context.json``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from unittest import mock

ROOT = Path(__file__).resolve().parents[1]
HIDDEN = 256
MODEL = dict(
    model_type="llama",
    hidden_size=HIDDEN,
    intermediate_size=7 * HIDDEN // 2,
    num_hidden_layers=2,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=HIDDEN // 32,
    vocab_size=8192,
    max_position_embeddings=1 << 22,
    tie_word_embeddings=False,
    rms_norm_eps=1e-5,
)
CHUNK = 64


def _config(tmp: Path, seq: int) -> Path:
    (tmp / "model").mkdir(parents=True, exist_ok=True)
    (tmp / "model" / "config.json").write_text(json.dumps(MODEL))
    lines = [
        f"base_model: {tmp / 'model'}",
        "tokenizer: builtin:stdlib",
        "datasets:",
        f"  - {{path: builtin:stdlib, max_files: {max(40, seq // 80)}}}",
        f"sequence_len: {seq}",
        "micro_batch_size: 1",
        "learning_rate: 1.0e-4",
        "bf16: true",
        f"output_dir: {tmp / 'run'}",
        f"dataset_cache_dir: {tmp / 'cache'}",
        "context_parallel_size: 8",
        "cp_comm_strategy: ulysses",
        "tiled_mlp: true",
        "activation_offloading: true",
        "fsdp_config: {activation_checkpointing: true}",
        f"loss_chunk_tokens: {CHUNK}",
    ]
    (tmp / "cfg.yaml").write_text("\n".join(lines) + "\n")
    return tmp / "cfg.yaml"


def upper_bound_mib(seq: int) -> float:
    """The planner's previous layer-backward bound for the same run (no MLP half freed)."""
    from ndparallel.plan import memory
    from ndparallel.plan.hardware import get_preset
    from ndparallel.plan.layout import Layout, Settings
    from ndparallel.plan.models import from_hf_config

    s = Settings(
        seq_len=seq,
        checkpointing=True,
        mixed_precision="bf16",
        loss_impl="chunked",
        loss_chunk_tokens=CHUNK,
        cp_strategy="ulysses",
        tiled_mlp=True,
        activation_offloading=True,
    )
    spec, lay, hw = from_hf_config(MODEL), Layout(cp=8), get_preset("h100-80gb")
    with mock.patch.object(memory, "mlp_half_saved_per_token", lambda *a: 0.0):
        before = memory.estimate_memory(spec, lay, s, hw)
    now = memory.estimate_memory(spec, lay, s, hw)
    return (before.allocated - now.allocated) / 2**20


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seq", type=int, default=32768)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "ndparallel", "simulate", str(_config(Path(tmp), args.seq))]
        cmd += ["--world-size", "8", "--rank", "0", "--steps", "1", "--json"]
        t0 = time.perf_counter()
        out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if out.returncode != 0:
        sys.exit(f"simulate failed: {out.stderr.strip().splitlines()[-1:]}")
    r = json.loads(out.stdout)
    m, p = r["measured"]["tensor_peak_gib"] * 1024, r["predicted"]["tensor_peak_gib"] * 1024
    row = {
        "seq": args.seq,
        "tokens_per_rank": args.seq // 8,
        "measured_mib": m,
        "predicted_mib": p,
        "error": p / m - 1,
        "previous_bound_mib": p + upper_bound_mib(args.seq),
        "peak_phase": r["predicted"].get("peak_phase"),
        "wall_s": time.perf_counter() - t0,
    }
    print(json.dumps(row, indent=1))
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "simulate_long_context.json").write_text(json.dumps(row, indent=2))


if __name__ == "__main__":
    main()
