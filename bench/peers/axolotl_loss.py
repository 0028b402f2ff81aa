"""Axolotl's own trainer next to ``ndparallel train``: the per-step losses of one YAML config.

    python bench/peers/axolotl_loss.py [--venv /work/venvs/axolotl] [--steps 10] [--work DIR]

1. The inputs of the side-by-side harness (``axolotl_inputs.py``: a local BPE tokenizer, local
   alpaca data) and a tiny Llama (hidden 64, 2 layers, fp32, seeded) saved with ``save_pretrained``.
2. One config both tools read (``CONFIG`` below): 1 process, AdamW with no weight decay, a constant
   learning rate and no warmup, Axolotl's default data order (the merged datasets shuffled by
   ``seed``, then transformers' ``RandomSampler`` seeded by it), no dropout (the Llama has none),
   fp32, ``sample_packing: false``, ``logging_steps: 1``. Only ``output_dir`` and
   ``dataset_prepared_path`` differ between the two copies (each tool refuses or overwrites the
   other's). ``--gradient-accumulation-steps`` (default 1): above 1 Axolotl averages the
   micro-batches' own token means, ndparallel's default the global batch's (docs/axolotl.md).
3. Axolotl 0.19.0's trainer (``python -m axolotl.cli.train CFG`` in the side venv that
   ``axolotl.py`` builds, on CPU, offline) and its ``trainer_state.json`` ``log_history``; then
   ``ndparallel train CFG --nproc-per-node 1`` (this repository's Python) and its ``metrics.jsonl``.
4. A table step / Axolotl loss / ndparallel loss / difference (and the gradient norms), written as
   ``bench/results/axolotl_loss_ga<G>[_dp<N>].json``; the dated tables:
   ``bench/reference/axolotl_parity.md`` ("Loss parity with Axolotl's trainer").

``--nproc-per-node N`` runs both on N CPU processes (Axolotl under ``torchrun`` with gloo, through
``axolotl_cpu_ranks.py``, its DDP; ndparallel on N dp ranks). Above one micro-batch per step
(accumulation or ranks) ndparallel's copy sets ``loss_reduction: micro_batch_mean``, Axolotl's
normalisation (``--default-loss``: leave it unset, the global token mean).

``--fixture`` runs on the parity fixtures' own tokenizer and alpaca data
(``tests/fixtures/axolotl/parity/``), saves the seeded model there (``model/model.safetensors``) and
writes Axolotl's losses to ``trainer_losses.json`` beside them (``trainer_losses_ga<G>_dp<N>.json``
above one micro-batch per step): ``tests/test_axolotl_parity.py`` trains ndparallel on the same
config and holds its losses to them (no Axolotl needed there).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
FIXTURES = REPO / "tests" / "fixtures" / "axolotl" / "parity"

# this folder's files are named after the tools they compare with: last on the path
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE] + [str(HERE), str(HERE.parent)]
from _common import write_json  # noqa: E402
from axolotl_inputs import write_inputs  # noqa: E402

CONFIG = {
    "sequence_len": 256,
    "micro_batch_size": 2,
    "num_epochs": 1,
    "optimizer": "adamw_torch",
    "learning_rate": 1.0e-3,
    "lr_scheduler": "constant",
    "warmup_steps": 0,
    "weight_decay": 0.0,
    "max_grad_norm": 1.0,
    "seed": 42,
    "sample_packing": False,
    "train_on_inputs": False,
    "bf16": False,
    "fp16": False,
    "tf32": False,
    "val_set_size": 0,
    "logging_steps": 1,
    "save_steps": 1000,
}
"""The shared keys; ``base_model``, ``datasets``, ``max_steps`` and the paths are added."""


NDPARALLEL_MAIN = "import sys; from ndparallel.cli import main; sys.exit(main())"
"""``ndparallel`` (the console script) with this Python: the package from ``PYTHONPATH`` if set."""


def make_model(model_dir: Path) -> None:
    """A seeded tiny Llama next to the harness's tokenizer (``write_model_dir`` wrote its config)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig.from_pretrained(model_dir)).to(torch.float32).save_pretrained(model_dir)


def write_config(
    inputs: Path, work: Path, tool: str, steps: int, accumulation: int, extra: dict | None = None
) -> Path:
    cfg = {
        "base_model": str(inputs / "model"),
        "datasets": [{"path": str(inputs / "data" / "alpaca.jsonl"), "type": "alpaca", "ds_type": "json"}],
        **CONFIG,
        "gradient_accumulation_steps": accumulation,
        "max_steps": steps,
        "dataset_prepared_path": str(work / f"prepared-{tool}"),
        "output_dir": str(work / f"out-{tool}"),
        **(extra or {}),
    }
    path = work / f"{tool}.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def offline_env(**extra: str) -> dict[str, str]:
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "WANDB_DISABLED": "true",
        "WANDB_MODE": "disabled",
        "AXOLOTL_DO_NOT_TRACK": "1",
        "DO_NOT_TRACK": "1",
        "CUDA_VISIBLE_DEVICES": "",
        **extra,
    }
    return env


def run(cmd: list[str], env: dict, cwd: Path, log: Path) -> float:
    start = time.perf_counter()
    with log.open("w") as out:
        proc = subprocess.run(cmd, env=env, cwd=cwd, stdout=out, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        tail = "\n".join(log.read_text().splitlines()[-40:])
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}); the end of {log}:\n{tail}")
    return time.perf_counter() - start


def axolotl_steps(out_dir: Path) -> list[dict]:
    """``log_history`` of the last ``trainer_state.json`` Axolotl wrote (a checkpoint's or the run's)."""
    states = sorted(out_dir.rglob("trainer_state.json"), key=lambda p: p.stat().st_mtime)
    if not states:
        raise SystemExit(f"no trainer_state.json under {out_dir}")
    history = json.loads(states[-1].read_text())["log_history"]
    return [
        {"step": h["step"], "loss": h["loss"], "grad_norm": h.get("grad_norm")}
        for h in history
        if "loss" in h
    ]


def ndparallel_steps(out_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [
        {"step": r["step"], "loss": r["loss"], "grad_norm": r.get("grad_norm")} for r in rows if "loss" in r
    ]


def first_batch_losses(
    work: Path, model_dir: Path, micro_batch_size: int, accumulation: int
) -> dict[str, float]:
    """Step 1's loss recomputed here from the examples Axolotl prepared (the first its sampler draws:
    ``torch.randperm`` seeded by ``seed``) and the initial model, under
    both normalisations: the global batch's trained-token mean (ndparallel) and the mean of the
    micro-batches' own token means (Axolotl 0.19: it turns off the Trainer's ``num_items_in_batch``
    for a model whose inner ``forward`` does not name it, so each micro-batch is averaged alone)."""
    from ndparallel.runtime.quiet import quiet_library_noise

    quiet_library_noise()
    import datasets
    import torch
    from transformers import LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    prepared = next((work / "prepared-axolotl").glob("*/dataset_info.json")).parent
    prepared = datasets.load_from_disk(str(prepared))
    order = torch.randperm(
        len(prepared), generator=torch.Generator().manual_seed(CONFIG["seed"])
    )  # its sampler
    rows = prepared.select(order[: micro_batch_size * accumulation].tolist())
    model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    sums, counts = [], []
    with torch.no_grad():
        for r in rows:
            logits = model(torch.tensor([r["input_ids"]])).logits[0, :-1]
            targets = torch.tensor(r["labels"][1:])
            loss = torch.nn.functional.cross_entropy(logits, targets, ignore_index=-100, reduction="sum")
            sums.append(loss.double().item())
            counts.append(int((targets != -100).sum()))
    micro = [
        sum(sums[i : i + micro_batch_size]) / sum(counts[i : i + micro_batch_size])
        for i in range(0, len(sums), micro_batch_size)
    ]
    return {
        "global_token_mean": sum(sums) / sum(counts),
        "mean_of_micro_batch_means": sum(micro) / len(micro),
    }


def versions(python: Path, env: dict) -> dict[str, str]:
    """The versions of what produced the losses: Axolotl's venv and this Python."""
    probe = "import axolotl, accelerate, torch, transformers as t; print(axolotl.__version__, t.__version__,"
    probe += " torch.__version__, accelerate.__version__)"
    out = subprocess.run([str(python), "-c", probe], capture_output=True, text=True, env=env).stdout.split()
    import torch
    import transformers

    keys = ("axolotl", "transformers (its venv)", "torch (its venv)", "accelerate (its venv)")
    here = {"transformers (here)": transformers.__version__, "torch (here)": torch.__version__}
    return {**dict(zip(keys, out)), **here}


def table(theirs: list[dict], ours: list[dict]) -> list[dict]:
    by_step = {r["step"]: r for r in ours}
    rows = []
    for t in theirs:
        o = by_step.get(t["step"], {})
        rows.append(
            {
                "step": t["step"],
                "axolotl_loss": t["loss"],
                "ndparallel_loss": o.get("loss"),
                "loss_diff": None if o.get("loss") is None else o["loss"] - t["loss"],
                "axolotl_grad_norm": t["grad_norm"],
                "ndparallel_grad_norm": o.get("grad_norm"),
            }
        )
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--venv", type=Path, default=Path("/work/venvs/axolotl"))
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument(
        "--gradient-accumulation-steps",
        type=int,
        default=1,
        help="1 (default); above 1 ndparallel runs with loss_reduction: micro_batch_mean (Axolotl's)",
    )
    parser.add_argument("--nproc-per-node", type=int, default=1, help="CPU processes (dp ranks) of each")
    parser.add_argument(
        "--default-loss", action="store_true", help="ndparallel without loss_reduction: micro_batch_mean"
    )
    parser.add_argument("--work", type=Path, default=None, help="default: a new temporary folder")
    parser.add_argument("--skip-axolotl", action="store_true", help="reuse WORK's out-axolotl")
    parser.add_argument(
        "--fixture", action="store_true", help="the parity fixtures' inputs; write the fixture"
    )
    args = parser.parse_args(argv)
    work = (args.work or Path(tempfile.mkdtemp(prefix="axolotl-loss-"))).resolve()
    work.mkdir(parents=True, exist_ok=True)
    inputs = FIXTURES if args.fixture else work / "inputs"
    if not (inputs / "model" / "model.safetensors").exists():
        if not args.fixture:
            write_inputs(inputs)
        make_model(inputs / "model")
    for old in ["out-ndparallel", "prepared-ndparallel"] + ([] if args.skip_axolotl else ["out-axolotl"]):
        shutil.rmtree(work / old, ignore_errors=True)
    ga, nproc = args.gradient_accumulation_steps, args.nproc_per_node
    several = ga > 1 or nproc > 1
    ours_extra = {"loss_reduction": "micro_batch_mean"} if several and not args.default_loss else {}
    theirs_cfg = write_config(inputs, work, "axolotl", args.steps, ga)
    ours_cfg = write_config(inputs, work, "ndparallel", args.steps, ga, ours_extra)

    python = args.venv / "bin" / "python"
    axolotl_cmd = [str(python), "-m", "axolotl.cli.train", str(theirs_cfg)]
    if nproc > 1:  # torchrun of the side venv: gloo on CPU
        axolotl_cmd = [str(python), "-m", "torch.distributed.run", f"--nproc-per-node={nproc}"]
        axolotl_cmd += [str(HERE / "axolotl_cpu_ranks.py"), str(theirs_cfg)]
    env = offline_env(**({"ACCELERATE_USE_CPU": "true"} if nproc > 1 else {}))  # else no DDP on CPU
    env.pop("PYTHONPATH", None)
    if not args.skip_axolotl:
        secs = run(axolotl_cmd, env, work, work / "axolotl.log")
        print(f"axolotl: {secs:.0f} s", flush=True)
    ours_cmd = [sys.executable, "-c", NDPARALLEL_MAIN, "train", str(ours_cfg), "--nproc-per-node", str(nproc)]
    secs = run(ours_cmd, offline_env(), work, work / "ndparallel.log")
    print(f"ndparallel: {secs:.0f} s", flush=True)

    rows = table(axolotl_steps(work / "out-axolotl"), ndparallel_steps(work / "out-ndparallel"))
    print(
        f"\n{'step':>4} {'Axolotl loss':>14} {'ndparallel loss':>16} {'difference':>11}"
        f" {'grad norms (A / n)':>24}"
    )
    for r in rows:
        diff = "-" if r["loss_diff"] is None else f"{r['loss_diff']:+.1e}"
        ours = "-" if r["ndparallel_loss"] is None else f"{r['ndparallel_loss']:.6f}"
        norms = (
            f"{r['axolotl_grad_norm'] or float('nan'):.6f} / {r['ndparallel_grad_norm'] or float('nan'):.6f}"
        )
        print(f"{r['step']:>4} {r['axolotl_loss']:>14.6f} {ours:>16} {diff:>11} {norms:>24}")
    check = first_batch_losses(
        work, inputs / "model", CONFIG["micro_batch_size"], ga * nproc
    )  # dp rank r's k-th micro-batch: rows [(k·N + r)·B, +B) of the draw
    print(
        f"step 1 recomputed from Axolotl's examples: global token mean {check['global_token_mean']:.6f}, "
        f"mean of the micro-batches' means {check['mean_of_micro_batch_means']:.6f}"
    )
    version = subprocess.run(
        [str(python), "-c", "import axolotl; print(axolotl.__version__)"],
        capture_output=True,
        text=True,
        env=env,
    ).stdout.strip()
    path = write_json(
        f"axolotl_loss_ga{ga}" + (f"_dp{nproc}" if nproc > 1 else ""),
        {
            "axolotl": version,
            "config": yaml.safe_load(ours_cfg.read_text()),
            "commands": [" ".join(axolotl_cmd), " ".join(ours_cmd)],
            "steps": rows,
            "step1_recomputed": check,
            "max_abs_loss_diff": max(abs(r["loss_diff"]) for r in rows if r["loss_diff"] is not None),
        },
    )
    print(f"\n{path}")
    if args.fixture:
        fixture = FIXTURES / ("trainer_losses" + (f"_ga{ga}_dp{nproc}" if several else "") + ".json")
        config = yaml.safe_load(theirs_cfg.read_text())
        config["base_model"] = "model"
        config["datasets"][0]["path"] = "data/alpaca.jsonl"
        for key in ("dataset_prepared_path", "output_dir"):
            config.pop(key)
        steps = axolotl_steps(work / "out-axolotl")
        fixture.write_text(
            json.dumps(
                {
                    "axolotl": version,
                    "command": f"python bench/peers/axolotl_loss.py --fixture --steps {args.steps}"
                    f" --gradient-accumulation-steps {ga} --nproc-per-node {nproc}"
                    f" (Axolotl's trainer, {nproc} process{'es' if nproc > 1 else ''})",
                    "date": time.strftime("%Y-%m-%d", time.gmtime()),
                    "versions": versions(python, env),
                    "config": config,
                    "steps": steps,
                },
                indent=1,
            )
            + "\n"
        )
        print(fixture)
    return 0


if __name__ == "__main__":
    sys.exit(main())
