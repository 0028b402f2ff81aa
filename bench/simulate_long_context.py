"""The long-context planner terms against ``ndparallel simulate`` of one CP rank (issue 50).

    nice -n 10 python bench/simulate_long_context.py [--seq 32768] [--trace] [--out DIR]

Llama-3.1-8B's shape shrunk in width only where the per-token ratios survive: 32 query / 8 K/V
heads, head dim h/32, MLP 3.5·h, at h = 256 (8B: 4096), 2 layers, an 8k vocabulary (the builtin
tokenizer's), bf16, AdamW, chunked loss in 64-token chunks (so the loss is not the peak, as at
millions of tokens), and the long-context settings of ``plan --max-seq-len --cp-comm-strategy ulysses``'s
longest row: CP 8 with Ulysses, activation checkpointing, tiled MLP, activation offloading. Rank 0
of world 8. Prints the measured tensor peak (``runtime/memory_probe.py``: device memory; the
offloader's host copies, pinned host memory on a GPU, apart) beside the planner's ``allocated`` as
the simulation reports it, and both sides' offloaded host memory. ``--trace`` runs the rank in this
process with ``LiveBytes(trace=True)`` and adds what is alive at the peak, grouped by origin (op,
autograd node, frame). Writes ``simulate_long_context.json``.
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


def _run_cli(cfg: Path) -> dict:
    cmd = [sys.executable, "-m", "ndparallel", "simulate", str(cfg)]
    cmd += ["--world-size", "8", "--rank", "0", "--steps", "1", "--json"]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if out.returncode != 0:
        sys.exit(f"simulate failed: {out.stderr.strip().splitlines()[-1:]}")
    return json.loads(out.stdout)


def _run_traced(cfg: Path) -> tuple[dict, list]:
    """The same rank in this process, its probe tracing: (report, what is alive at the peak)."""
    from ndparallel.axolotl import load_config
    from ndparallel.runtime import memory_probe
    from ndparallel.runtime.startup import import_model_libraries
    from ndparallel.tools import simulate as sim

    probes = []

    def traced():
        probes.append(memory_probe.LiveBytes(trace=True))
        return probes[-1]

    config = load_config(str(cfg), [])
    import_model_libraries()
    with mock.patch.object(sim, "LiveBytes", traced):
        report = sim.simulate(config, sim.SimulationRequest(world_size=8, rank=0, steps=1))
    held = [{"mib": n / 2**20, "op": o[0], "node": o[1], "at": o[2]} for o, n in probes[-1].at_peak()]
    return report, [h for h in held if abs(h["mib"]) >= 1 / 64]


def memory_row(report: dict) -> dict:
    """A ``simulate --json`` report's memory, measured against the planner: the tensor peak (MiB,
    the error), the offloaded host memory both ways, the peak's phase and the planner's parts."""
    m, p = report["measured"], report["predicted"]
    return {
        "measured_mib": m["tensor_peak_gib"] * 1024,
        "predicted_mib": p["tensor_peak_gib"] * 1024,
        "error": p["tensor_peak_gib"] / m["tensor_peak_gib"] - 1,
        "offload_host_measured_mib": m.get("offload_host_peak_gib", 0.0) * 1024,
        "offload_host_predicted_mib": p.get("offload_host_gib", 0.0) * 1024,
        "peak_phase": p.get("peak_phase"),
        "predicted_breakdown_mib": {k: v * 1024 for k, v in p.get("memory_gib", {}).items()},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seq", type=int, default=32768)
    ap.add_argument("--trace", action="store_true", help="list what is alive at the measured peak")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    args = ap.parse_args()
    held = None
    with tempfile.TemporaryDirectory() as tmp:
        cfg = _config(Path(tmp), args.seq)
        t0 = time.perf_counter()
        r, held = _run_traced(cfg) if args.trace else (_run_cli(cfg), None)
    row = {
        "seq": args.seq,
        "tokens_per_rank": args.seq // 8,
        **memory_row(r),
        "states_mib": sum(r["measured"]["state_gib"].values()) * 1024,
        "wall_s": time.perf_counter() - t0,
        **({"alive_at_peak": held} if held is not None else {}),
    }
    print(json.dumps(row, indent=1))
    Path(args.out).mkdir(parents=True, exist_ok=True)
    name = f"simulate_long_context{'' if args.seq == 32768 else f'_{args.seq}'}.json"
    (Path(args.out) / name).write_text(json.dumps(row, indent=2))


if __name__ == "__main__":
    main()
