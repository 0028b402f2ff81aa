"""The searched settings end to end: ``plan --explain ROW --write-config`` of a tiny config, then
``ndparallel simulate`` of the written file — the planner's tensor peak for the row against the
measured one (goal: within 10 %), and the round trip (``simulate``'s prediction of the written config
is the plan's row: what was planned is what runs).

    python bench/simulate_settings.py [--out DIR] [--only NAME ...] [--seq 256]

Model: Llama, hidden 256, 4 layers, vocab 2048, fp32, world 8, micro-batch 2, rank 0. One row per
setting: no checkpointing, selective, selective without resharding after forward, full offloaded,
selective offloaded under TP 2. Writes ``simulate_settings.json`` into ``--out`` (default
bench/results).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODEL = dict(
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    vocab_size=2048,
    max_position_embeddings=4096,
    tie_word_embeddings=False,
)
ON = "micro_batch_size=2,activation_checkpointing=on"
SEL = f"{ON},ac_policy=selective"
ROWS = {
    "none": "1x8x1x1,micro_batch_size=2,activation_checkpointing=off,reshard_after_forward=on",
    "selective": f"1x8x1x1,{SEL},activation_offloading=off,reshard_after_forward=on",
    "selective-kept": f"1x8x1x1,{SEL},activation_offloading=off,reshard_after_forward=off",
    "full-offloaded": f"1x8x1x1,{ON},ac_policy=full,activation_offloading=on,reshard_after_forward=on",
    "selective-offloaded-tp2": f"1x4x1x2,{SEL},activation_offloading=on,reshard_after_forward=off",
}
"""--explain rows: a layout and every searched setting pinned."""


def _cli(*args: str) -> str:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [sys.executable, "-m", "ndparallel", *args], capture_output=True, text=True, env=env, check=False
    )
    if done.returncode:
        raise RuntimeError(f"ndparallel {args[0]} failed: {done.stderr[-2000:]}")
    return done.stdout


def run_row(tmp: Path, config: Path, name: str, row: str) -> dict:
    written = tmp / f"{name}.yaml"
    planned = json.loads(
        _cli(
            "plan",
            "--config",
            str(config),
            "--gpus",
            "8",
            "--explain",
            row,
            "--write-config",
            str(written),
            "--json",
        )
    )
    report = json.loads(_cli("simulate", str(written), "--world-size", "8", "--steps", "1", "--json"))
    plan_peak = planned["best"]["memory_gib"]["allocated"]
    return {
        "row": name,
        "chosen": planned["chosen"],
        "plan_tensor_peak_gib": plan_peak,
        "simulate_predicted_gib": report["predicted"]["tensor_peak_gib"],
        "measured_tensor_peak_gib": report["measured"]["tensor_peak_gib"],
        "error": report["predicted"]["error"]["tensor_peak"],
        "round_trip": abs(report["predicted"]["tensor_peak_gib"] / plan_peak - 1) < 1e-6,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    ap.add_argument("--only", nargs="*", default=list(ROWS))
    ap.add_argument("--seq", type=int, default=256)
    opts = ap.parse_args()
    from transformers import LlamaConfig

    rows = []
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        LlamaConfig(**MODEL).save_pretrained(tmp / "model")  # config.json only
        config = tmp / "cfg.yaml"
        config.write_text(
            f"base_model: {tmp / 'model'}\ntokenizer: builtin:stdlib\n"
            "datasets:\n  - {path: builtin:stdlib, max_files: 200}\n"
            f"sequence_len: {opts.seq}\nmicro_batch_size: 2\noutput_dir: {tmp / 'run'}\n"
        )
        print("| row | chosen | plan GiB | measured GiB | error | round trip |")
        for name in opts.only:
            r = run_row(tmp, config, name, ROWS[name])
            rows.append(r)
            chosen = r["chosen"]
            policy = chosen["ac_policy"] if chosen["activation_checkpointing"] else "off"
            plan_peak, measured = r["plan_tensor_peak_gib"], r["measured_tensor_peak_gib"]
            print(
                f"| {name} | {policy} | {plan_peak:.4f} | {measured:.4f} | {r['error']:+.1%} | "
                f"{r['round_trip']} |",
                flush=True,
            )
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "simulate_settings.json").write_text(json.dumps({"seq": opts.seq, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
