"""The scale issue's GPU rows: one real rank of large worlds on one GPU (``ndparallel simulate``),
measured peak memory and compute time against the planner.

    python bench/gpu_simulate.py [--out DIR] [--only NAME ...]     # on a GPU machine
    python bench/gpu_simulate.py --cpu-smoke [--out DIR]           # the same code path, tiny, on CPU

Rows (bf16, activation checkpointing, the built-in corpus and tokenizer: no download; published
model shapes resolved offline):
  * Llama-3.1-8B  HSDP 2×4 × TP 2, world 16, seq 2048
  * Qwen3-8B      FSDP 2 × CP 2 × TP 2, world 8, seq 8192
  * Llama-3.1-70B FSDP 8 × TP 8, world 64, seq 8192
  * Llama-3.1-405B FSDP 64 × TP 8, world 512, seq 8192
Each row's report (``simulate --json``) goes to ``DIR/simulate-NAME.json`` as soon as it ends, and
one summary line is printed per row; a row that fails is reported and the others still run.
Exit code 1 if any row failed. Default DIR: ``$OUT`` if set, else ``bench/results``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
import time
from pathlib import Path

from _warm_python import child_python  # sys.executable; the warm one under --cpu-smoke

ROOT = Path(__file__).resolve().parents[1]
COMMON = {
    "tokenizer": "builtin:stdlib",
    "bf16": True,
    "micro_batch_size": 1,
    "fsdp_config": {"activation_checkpointing": True},
}
ROWS = {
    "llama-3.1-8b-hsdp2x4-tp2": (
        {
            "base_model": "meta-llama/Llama-3.1-8B",
            "dp_replicate_size": 2,
            "dp_shard_size": 4,
            "tensor_parallel_size": 2,
            "sequence_len": 2048,
        },
        16,
    ),
    "qwen3-8b-fsdp2-cp2-tp2": (
        {
            "base_model": "Qwen/Qwen3-8B",
            "dp_shard_size": 2,
            "context_parallel_size": 2,
            "tensor_parallel_size": 2,
            "sequence_len": 8192,
        },
        8,
    ),
    "llama-3.1-70b-fsdp8-tp8": (
        {
            "base_model": "meta-llama/Llama-3.1-70B",
            "dp_shard_size": 8,
            "tensor_parallel_size": 8,
            "sequence_len": 8192,
        },
        64,
    ),
    "llama-3.1-405b-fsdp64-tp8": (
        {
            "base_model": "meta-llama/Llama-3.1-405B",
            "dp_shard_size": 64,
            "tensor_parallel_size": 8,
            "sequence_len": 8192,
        },
        512,
    ),
}
SMOKE = {
    "tiny-fsdp2-cp2-tp2": (
        {
            "base_model": "tiny-llama",
            "dp_shard_size": 2,
            "context_parallel_size": 2,
            "tensor_parallel_size": 2,
            "sequence_len": 64,
            "bf16": False,
            "datasets": [{"path": "builtin:stdlib", "max_files": 20}],  # 2 tiny steps need few rows
        },
        8,
    )
}


def _config(tmp: Path, name: str, fields: dict) -> Path:
    import yaml

    cfg = {
        **COMMON,
        "datasets": [{"path": "builtin:stdlib", "max_files": 200}],
        **fields,
        "output_dir": str(tmp / name),
        "dataset_cache_dir": str(tmp / "cache"),
    }
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT") or str(ROOT / "bench" / "results"))
    ap.add_argument("--only", nargs="*", default=None, help="row names to run")
    ap.add_argument("--cpu-smoke", action="store_true", help="the tiny CPU row instead of the GPU rows")
    ap.add_argument("--steps", type=int, default=2)
    args = ap.parse_args()
    rows = SMOKE if args.cpu_smoke else {k: v for k, v in ROWS.items() if not args.only or k in args.only}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, **({"NDPARALLEL_DEVICE": "cpu"} if args.cpu_smoke else {})}
    failed = 0
    with tempfile.TemporaryDirectory() as tmp:
        for name, (fields, world) in rows.items():
            t0 = time.perf_counter()
            run = subprocess.run(
                [
                    child_python(),
                    "-m",
                    "ndparallel",
                    "simulate",
                    str(_config(Path(tmp), name, fields)),
                    "--world-size",
                    str(world),
                    "--steps",
                    str(args.steps),
                    "--json",
                ],
                capture_output=True,
                text=True,
                cwd=ROOT,
                env=env,
            )
            wall = time.perf_counter() - t0
            if run.returncode != 0 or not run.stdout.strip().startswith("{"):
                failed += 1
                (out / f"simulate-{name}.err").write_text(run.stderr)
                print(
                    f"FAIL {name}: exit {run.returncode} after {wall:.0f} s: {run.stderr.strip()[-300:]}",
                    flush=True,
                )
                continue
            report = json.loads(run.stdout)
            report["wall_s"] = wall
            (out / f"simulate-{name}.json").write_text(json.dumps(report, indent=2))
            m, p = report["measured"], report["predicted"]
            print(
                f"PASS {name}: world {world}, {wall:.0f} s; peak {m['peak_memory_gib']:.2f} GiB vs predicted "
                f"{p['peak_memory_gib']:.2f} ({p['error']['peak_memory']:+.1%}); step compute "
                f"{m['step_time_s']:.3f} s vs {p['step_time_s']:.3f} ({p['error']['step_time']:+.1%})",
                flush=True,
            )
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
