"""``ndparallel simulate`` at scale on CPU, and how faithful it is.

    python bench/simulate_scale.py [--out DIR] [--worlds 64 256 1024] [--skip-faithful]

(a) Faithful: rank 0 of a simulated 8-rank world vs the real 8-rank gloo run of the same config
    (``ndparallel train``, same steps): peak RSS per rank (what ``train`` logs as
    ``peak_memory_gb``), goal within 10 %.
(b) At scale: a ~0.13B Llama (hidden 768, 12 layers, vocab 32k) at worlds 64, 256 and 1024, FSDP and
    FSDP × CP 2 × TP 2: the simulated rank's measured tensor peak, RSS peak and compute time vs the
    planner's prediction, collective bytes per mesh dim vs the planner's, and the wall time of each
    simulation (goal: under 5 minutes).

Prints tables and writes ``simulate_scale.json`` into ``--out`` (default ``bench/results``).
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
MODEL = dict(
    hidden_size=768,
    intermediate_size=2048,
    num_hidden_layers=12,
    num_attention_heads=12,
    num_key_value_heads=4,
    vocab_size=32000,
    max_position_embeddings=2048,
    tie_word_embeddings=False,
)
LAYOUTS = {
    "FSDP": {"dp_shard_size": -1},
    "FSDP x CP 2 x TP 2": {"dp_shard_size": -1, "context_parallel_size": 2, "tensor_parallel_size": 2},
}


def _config(tmp: Path, layout: dict, seq: int = 256, micro_batch: int = 1) -> Path:
    from transformers import LlamaConfig

    model_dir = tmp / "model"
    if not (model_dir / "config.json").exists():
        LlamaConfig(**MODEL).save_pretrained(model_dir)  # the config alone: simulate reads no weights
    lines = [
        f"base_model: {model_dir}",
        "tokenizer: builtin:stdlib",
        "datasets:",
        "  - {path: builtin:stdlib, max_files: 400}",
        f"sequence_len: {seq}",
        f"micro_batch_size: {micro_batch}",
        "learning_rate: 1.0e-4",
        "logging_steps: 1",
        f"output_dir: {tmp / 'run'}",
        f"dataset_cache_dir: {tmp / 'cache'}",
        *(f"{k}: {v}" for k, v in layout.items()),
    ]
    path = tmp / f"cfg-{abs(hash(json.dumps(layout))) % 10**8}.yaml"
    path.write_text("\n".join(lines) + "\n")
    return path


def simulate(config: Path, world: int, steps: int = 2, extra: tuple = ()) -> tuple[dict, float]:
    t0 = time.perf_counter()
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "ndparallel",
            "simulate",
            str(config),
            "--world-size",
            str(world),
            "--steps",
            str(steps),
            "--json",
            *extra,
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    if out.returncode != 0:
        raise RuntimeError(f"simulate failed ({out.returncode}): {out.stderr[-2000:]}")
    return json.loads(out.stdout), time.perf_counter() - t0


FAITHFUL_MODEL = dict(
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    vocab_size=2048,
    max_position_embeddings=1024,
    tie_word_embeddings=False,
)


def faithful(tmp: Path, steps: int = 3) -> dict:
    """Rank 0 simulated in a world of 8 vs rank 0 of the real 8-rank gloo run (``train`` needs
    weights: a small model is saved with them): peak RSS."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    tmp = tmp / "faithful"
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(LlamaConfig(**FAITHFUL_MODEL)).save_pretrained(tmp / "model")
    layout = {"dp_shard_size": 2, "context_parallel_size": 2, "tensor_parallel_size": 2}
    config = _config(tmp, layout, seq=256, micro_batch=1)
    sim, _ = simulate(config, 8, steps=steps)
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "ndparallel",
            "train",
            str(config),
            "--set",
            f"max_steps={steps + 2}",
            "--set",
            "save_final_model=false",
            "--set",
            "overwrite_output_dir=true",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    if run.returncode != 0:
        raise RuntimeError(f"train failed: {run.stderr[-2000:]}")
    rows = [json.loads(line) for line in (tmp / "run" / "metrics.jsonl").read_text().splitlines()]
    real = max(r["peak_memory_gb"] for r in rows if "peak_memory_gb" in r)
    got = sim["measured"]["peak_memory_gib"]
    return {
        "layout": "FSDP 2 x CP 2 x TP 2 (world 8)",
        "real_peak_rss_gib": real,
        "simulated_peak_rss_gib": got,
        "error": (got - real) / real,
    }


def at_scale(tmp: Path, worlds: list[int]) -> list[dict]:
    rows = []
    for name, layout in LAYOUTS.items():
        config = _config(tmp, layout)
        for world in worlds:
            r, wall = simulate(config, world)
            m, p = r["measured"], r["predicted"]
            bytes_equal = {
                d: r["collectives"].get(d, {}).get("bytes")
                == r["predicted_collectives"].get(d, {}).get("bytes")
                for d in set(r["collectives"]) | set(r["predicted_collectives"])
            }
            rows.append(
                {
                    "layout": f"{name} (world {world})",
                    "describe": r["layout"]["describe"],
                    "world": world,
                    "wall_s": wall,
                    "tensor_peak_gib": m["tensor_peak_gib"],
                    "predicted_tensor_peak_gib": p["tensor_peak_gib"],
                    "tensor_error": p["error"]["tensor_peak"],
                    "peak_rss_gib": m["peak_memory_gib"],
                    "predicted_peak_gib": p["peak_memory_gib"],
                    "step_time_s": m["step_time_s"],
                    "predicted_step_time_s": p["step_time_s"],
                    "time_error": p["error"]["step_time"],
                    "collective_bytes_equal": all(bytes_equal.values()),
                    "collectives": r["collectives"],
                    "predicted_collectives": r["predicted_collectives"],
                }
            )
            print(
                f"{rows[-1]['layout']}: {wall:.0f} s, tensor peak {m['tensor_peak_gib'] * 1024:.1f} MiB vs "
                f"{p['tensor_peak_gib'] * 1024:.1f} predicted ({p['error']['tensor_peak']:+.1%}), step "
                f"{m['step_time_s']:.2f} s vs {p['step_time_s']:.2f} ({p['error']['step_time']:+.1%}), "
                f"collective bytes equal: {rows[-1]['collective_bytes_equal']}",
                flush=True,
            )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    ap.add_argument("--worlds", type=int, nargs="+", default=[64, 256, 1024])
    ap.add_argument("--skip-faithful", action="store_true")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        result = {"model": MODEL, "at_scale": at_scale(Path(tmp), args.worlds)}
        if not args.skip_faithful:
            result["faithful"] = faithful(Path(tmp))
            f = result["faithful"]
            print(
                f"faithful: {f['layout']}: real peak RSS {f['real_peak_rss_gib']:.3f} GiB, simulated "
                f"{f['simulated_peak_rss_gib']:.3f} GiB ({f['error']:+.1%})"
            )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "simulate_scale.json").write_text(json.dumps(result, indent=2))
    print(f"wrote {out / 'simulate_scale.json'}")


if __name__ == "__main__":
    main()
