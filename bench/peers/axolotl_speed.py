"""Axolotl's own trainer next to ``ndparallel train`` on one YAML: samples/s, real tokens/s, peak
memory and losses, on three of Axolotl's own kinds of config (issue 62).

    python bench/peers/axolotl_speed.py [--venv /work/venvs/axolotl] [--pairs 2] [--only alpaca,chat]

The setup (``CONFIGS``, ``MODEL``): a seeded Llama of 15.3M parameters (hidden 512, 5 layers, fp32,
saved once), the harness's byte-level BPE (``axolotl_inputs.py``), generated data — 200 alpaca
records, 200 chats (``chat_template``, ChatML), 800 raw documents (``completion``) —
``sequence_len: 1024``, ``micro_batch_size: 8``, 12 steps, ``adamw_torch`` at a constant 1e-4,
seed 42, one CPU process; three configs: alpaca and chat_template unpacked (Axolotl's defaults:
each batch padded to its longest sample — Axolotl rounds to 64, ndparallel to 8), completion
packed (both pad packed rows to ``sequence_len``). Both tools read the same YAML; only
``output_dir`` and ``dataset_prepared_path`` differ, and Axolotl's copy names a measuring plugin
(``axolotl_count_plugin.py``: it counts the tokens of each batch and times each step, changing
nothing it trains).

Each pair runs both tools one after the other, the next pair (of this config or the next) in the
other order (alternating), on whatever else the machine is running; a ratio is ndparallel /
Axolotl within one pair, and the median over the pairs is reported. Measured per run: the
training loop's wall time (from the start of training to the end of the last step, the first step
included: Axolotl's per-step times from the plugin's callback, ndparallel's ``step_time_s`` with
``logging_steps: 1``), samples/s (rows × steps / time), real tokens/s (tokens that are not
padding: Axolotl's counted on its batches, ndparallel's from its ``metrics.jsonl``), the padded
share of the computed tokens, the peak RSS of the largest process of each tool's process tree
(``wait4``), and the per-step losses (the unpacked configs draw the same samples each step in both
tools: their losses must be equal under ``agreement.model_floor``; packed rows differ by design,
docs/axolotl.md). Results: ``bench/results/axolotl_speed_<date>.json``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE] + [str(HERE), str(HERE.parent)]
from _common import write_json  # noqa: E402
from axolotl_inputs import alpaca_records, chat_records, completion_records, write_inputs  # noqa: E402
from axolotl_loss import NDPARALLEL_MAIN, axolotl_steps, ndparallel_steps, offline_env  # noqa: E402

MODEL = {"hidden_size": 512, "intermediate_size": 1376, "num_hidden_layers": 5, "num_attention_heads": 8}
SHARED = {
    "sequence_len": 1024,
    "micro_batch_size": 8,
    "gradient_accumulation_steps": 1,
    "max_steps": 12,
    "optimizer": "adamw_torch",
    "learning_rate": 1.0e-4,
    "lr_scheduler": "constant",
    "warmup_steps": 0,
    "weight_decay": 0.0,
    "max_grad_norm": 1.0,
    "seed": 42,
    "train_on_inputs": False,
    "chat_template": "tokenizer_default",
    "bf16": False,
    "fp16": False,
    "tf32": False,
    "val_set_size": 0,
    "logging_steps": 1,
    "save_steps": 1000,
}
CONFIGS = {
    "alpaca": {"datasets": [{"path": "data/alpaca200.jsonl", "type": "alpaca"}], "sample_packing": False},
    "chat": {
        "datasets": [
            {"path": "data/chat200.jsonl", "type": "chat_template", "roles_to_train": ["assistant"]}
        ],
        "sample_packing": False,
    },
    "completion": {
        "datasets": [{"path": "data/completion800.jsonl", "type": "completion"}],
        "sample_packing": True,
    },
}
DATA = {
    "alpaca200": lambda: alpaca_records(200, 11),
    "chat200": lambda: chat_records(200, 12),
    "completion800": lambda: completion_records(800, 13),
}


def write_setup(inputs: Path) -> None:
    """The harness's tokenizer, the bench's data and the seeded model (once)."""
    if (inputs / "model" / "model.safetensors").exists():
        return
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    write_inputs(inputs)
    for name, make in DATA.items():
        (inputs / "data" / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in make()))
    config = LlamaConfig.from_pretrained(inputs / "model")
    for key, value in MODEL.items():
        setattr(config, key, value)
    config.head_dim = config.hidden_size // config.num_attention_heads
    torch.manual_seed(0)
    LlamaForCausalLM(config).to(torch.float32).save_pretrained(inputs / "model")


def write_config(name: str, inputs: Path, run: Path, tool: str) -> Path:
    cfg = json.loads(json.dumps(CONFIGS[name]))
    for d in cfg["datasets"]:
        d.update(path=str(inputs / d["path"]), ds_type="json")
    cfg = {"base_model": str(inputs / "model"), **cfg, **SHARED}
    cfg.update(dataset_prepared_path=str(run / "prepared"), output_dir=str(run / "out"))
    if tool == "axolotl":
        cfg["plugins"] = ["axolotl_count_plugin.CountTokens"]
    path = run / "config.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def run_measured(cmd: list[str], env: dict, cwd: Path, log: Path) -> int:
    """Run ``cmd``; the peak RSS (bytes) of the largest process of its tree (``wait4``)."""
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=out, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        tail = "\n".join(log.read_text().splitlines()[-40:])
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}); the end of {log}:\n{tail}")
    return usage.ru_maxrss * 1024


def run_axolotl(name: str, inputs: Path, work: Path, python: Path) -> dict:
    run = work / f"axolotl-{name}"
    shutil.rmtree(run, ignore_errors=True)
    run.mkdir(parents=True)
    shutil.copy(HERE / "axolotl_count_plugin.py", run / "axolotl_count_plugin.py")
    cfg = write_config(name, inputs, run, "axolotl")
    env = offline_env(PYTHONPATH=str(run))  # the plugin only: this folder's axolotl.py would shadow Axolotl
    peak = run_measured([str(python), "-m", "axolotl.cli.train", str(cfg)], env, run, run / "log.txt")
    measured = json.loads((run / "out" / "measured.json").read_text())
    steps = SHARED["max_steps"]
    batches = measured["batches"][:steps]  # the loader may have collated one batch ahead
    return {
        "seconds": sum(measured["step_s"][:steps]),
        "step_s": measured["step_s"][:steps],
        "rows": sum(b["rows"] for b in batches),
        "real_tokens": sum(b["real"] for b in batches),
        "computed_tokens": sum(b["computed"] for b in batches),
        "peak_rss_bytes": peak,
        "losses": [s["loss"] for s in axolotl_steps(run / "out")],
    }


def run_ndparallel(name: str, inputs: Path, work: Path) -> dict:
    run = work / f"ndparallel-{name}"
    shutil.rmtree(run, ignore_errors=True)
    run.mkdir(parents=True)
    cfg = write_config(name, inputs, run, "ndparallel")
    cmd = [sys.executable, "-c", NDPARALLEL_MAIN, "train", str(cfg), "--nproc-per-node", "1"]
    peak = run_measured(cmd, offline_env(), run, run / "log.txt")
    rows = [json.loads(line) for line in (run / "out" / "metrics.jsonl").read_text().splitlines() if line]
    steps = [r for r in rows if "loss" in r]
    real = sum(r["tokens_per_s"] * r["step_time_s"] for r in steps)
    computed = sum(
        r["tokens_per_s"] * r["step_time_s"] / (1 - r["padding_fraction"]) if r["padding_fraction"] < 1 else 0
        for r in steps
    )
    return {
        "seconds": sum(r["step_time_s"] for r in steps),
        "step_s": [r["step_time_s"] for r in steps],
        "rows": SHARED["micro_batch_size"] * len(steps),
        "real_tokens": round(real),
        "computed_tokens": round(computed),
        "peak_rss_bytes": peak,
        "losses": [s["loss"] for s in ndparallel_steps(run / "out")],
    }


def rates(r: dict) -> dict:
    return {
        "samples_per_s": r["rows"] / r["seconds"],
        "real_tokens_per_s": r["real_tokens"] / r["seconds"],
        "padding_fraction": 1 - r["real_tokens"] / r["computed_tokens"],
    }


def losses_agree(theirs: list[float], ours: list[float], inputs: Path) -> dict:
    """The largest relative loss difference, held to ``agreement.model_floor`` of the model."""
    from transformers import LlamaConfig

    from ndparallel.tools.agreement import model_floor

    bound = model_floor(LlamaConfig.from_pretrained(inputs / "model"), len(theirs))
    worst = max(abs(a - b) / abs(a) for a, b in zip(theirs, ours))
    return {"max_rel_diff": worst, "bound": bound, "equal": worst <= bound}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--venv", type=Path, default=Path("/work/venvs/axolotl"))
    parser.add_argument("--pairs", type=int, default=2)
    parser.add_argument("--only", default=",".join(CONFIGS))
    parser.add_argument("--work", type=Path, default=None, help="default: a new temporary folder")
    args = parser.parse_args(argv)
    work = (args.work or Path(tempfile.mkdtemp(prefix="axolotl-speed-"))).resolve()
    inputs = work / "inputs"
    write_setup(inputs)
    python = args.venv / "bin" / "python"
    results: dict = {}
    runs = 0  # pairs so far, over every config: the order alternates from one pair to the next
    for name in args.only.split(","):
        pairs = []
        for i in range(args.pairs):
            order = ("axolotl", "ndparallel") if runs % 2 == 0 else ("ndparallel", "axolotl")
            runs += 1
            pair = {}
            for tool in order:
                t = time.perf_counter()
                r = (
                    run_axolotl(name, inputs, work, python)
                    if tool == "axolotl"
                    else run_ndparallel(name, inputs, work)
                )
                pair[tool] = {**r, **rates(r), "wall_s": time.perf_counter() - t}
                print(
                    f"{name} pair {i + 1} {tool:10s}: {pair[tool]['samples_per_s']:.2f} samples/s, "
                    f"{pair[tool]['real_tokens_per_s']:.0f} real tok/s, "
                    f"{pair[tool]['padding_fraction']:.0%} padding, "
                    f"peak RSS {r['peak_rss_bytes'] / 2**30:.2f} GiB",
                    flush=True,
                )
            a, n = pair["axolotl"], pair["ndparallel"]
            pair["ratios"] = {
                "samples_per_s": n["samples_per_s"] / a["samples_per_s"],
                "real_tokens_per_s": n["real_tokens_per_s"] / a["real_tokens_per_s"],
                "peak_rss": n["peak_rss_bytes"] / a["peak_rss_bytes"],
            }
            pair["losses"] = losses_agree(a["losses"], n["losses"], inputs)
            pairs.append(pair)
        median = {k: statistics.median(p["ratios"][k] for p in pairs) for k in pairs[0]["ratios"]}
        results[name] = {"config": CONFIGS[name], "pairs": pairs, "median_ratios": median}
        print(
            f"{name}: ndparallel / Axolotl (median of {len(pairs)} pairs): "
            + ", ".join(f"{k} {v:.2f}x" for k, v in median.items())
            + f"; losses equal: {all(p['losses']['equal'] for p in pairs)}",
            flush=True,
        )
    version = subprocess.run(
        [str(python), "-c", "import axolotl; print(axolotl.__version__)"],
        capture_output=True,
        text=True,
        env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
    ).stdout.strip()
    path = write_json(
        f"axolotl_speed_{datetime.date.today().isoformat()}",
        {"axolotl": version, "model": MODEL, "shared": SHARED, "results": results},
    )
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
