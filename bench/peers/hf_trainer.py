"""transformers' own ``Trainer`` on Hugging Face Accelerate, in one process: the fixtures the Trainer
door (``ndparallel.transformers``) is tested against.

    python bench/peers/hf_trainer.py [--out-dir tests/fixtures/trainer]

1. The tiny Llama and its tokenizer of ``tests/sft_fixtures.py`` (hidden 64, 2 layers, seeded), or
   for ``nd_parallel_trainer_moe`` its tiny Qwen3-MoE (``MODELS``), saved locally; the checksum of
   its weights goes into the fixture, so a test that builds another model fails on that first.
2. The scripts the door runs (``SCRIPTS``: our copy of Accelerate's ``nd_parallel_trainer.py``, and a
   script using the Trainer's own features) with their two ndparallel import lines put back to
   transformers' and Accelerate's, each run in a fresh process: one process, CPU, the arguments of
   ``RUNS``. The per-device batch is the global batch of the layouts the tests run with 1, 2 or 4
   data-parallel ranks (the same seeded sampler order: Accelerate's ``SeedableRandomSampler`` draws
   what the door's dp-sharded sampler draws).
3. Each fp32 run with several rows a batch again with every batch's rows in reverse order: the
   rule's second way (``tools/agreement.py``: the same training in real arithmetic, its sums in
   another order), its difference from the first run being the rounding this machine puts into this
   setup. The data set is re-ordered so that the seeded sampler hands out each batch's rows
   reversed. (A one-row batch reversed is itself: such a run is its own second way.)
4. Per step the logged loss, gradient norm and learning rate, the evaluation losses, the steps a
   callback saw; the peers' versions and the date: ``tests/fixtures/trainer/<script>.json``.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import subprocess
import sys
import tempfile
import types
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
# this folder's files are named after the tools they compare with (accelerate.py): off the import path
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]
SCRIPTS = {
    "nd_parallel_trainer": REPO / "tests" / "accelerate_scripts" / "nd_parallel_trainer.py",
    "nd_parallel_trainer_moe": REPO / "tests" / "accelerate_scripts" / "nd_parallel_trainer.py",
    "trainer_features": REPO / "tests" / "trainer_scripts" / "trainer_features.py",
    "trl_sft": REPO / "tests" / "trainer_scripts" / "trl_sft.py",
    "trl_dpo": REPO / "tests" / "trainer_scripts" / "trl_dpo.py",
}
FIXTURES = REPO / "tests" / "fixtures" / "trainer"
MODELS = {"nd_parallel_trainer_moe": "tiny_moe_dir"}
"""The model each script trains: a builder of ``tests/sft_fixtures.py`` (else ``tiny_llama_dir``)."""
PEER_IMPORTS = {
    "from ndparallel.transformers import Trainer, TrainingArguments": (
        "from transformers import Trainer, TrainingArguments"
    ),
    "from ndparallel.utils import ParallelismConfig": "from accelerate.utils import ParallelismConfig",
    "from ndparallel.trl import SFTConfig, SFTTrainer": "from trl import SFTConfig, SFTTrainer",
    "from ndparallel.trl import DPOConfig, DPOTrainer": "from trl import DPOConfig, DPOTrainer",
}
"""The scripts' ndparallel import lines and what they were (transformers', Accelerate's, TRL's)."""
COMMON = {
    "nd_parallel_trainer": [
        "--sequence-length", "32",
        "--max-steps", "3",
        "--logging-steps", "1",
        "--learning-rate", "0.5",
        "--optim", "sgd",
        "--checkpoint-frequency", "100",
        "--no-bf16",
        "--use-cpu",
        "--seed", "42",
    ],
    "trainer_features": ["--gradient-accumulation-steps", "2", "--report-to", "none"],
    "trl_sft": [],
    "trl_dpo": [],
}  # fmt: skip
COMMON["nd_parallel_trainer_moe"] = COMMON["nd_parallel_trainer"]
"""Each script's arguments besides the model, the output folder and the run's own (the tests read
them from the fixture)."""
RUNS = {
    "nd_parallel_trainer": {
        "batch1": ["--per-device-batch-size", "1"],
        "batch2": ["--per-device-batch-size", "2"],
        "batch4": ["--per-device-batch-size", "4"],
    },
    "nd_parallel_trainer_moe": {"batch2": ["--per-device-batch-size", "2"]},
    "trainer_features": {
        "fp32": ["--per-device-batch-size", "2", "--max-steps", "4"],
        "bf16_epoch": ["--per-device-batch-size", "2", "--max-steps", "-1", "--rows", "8", "--bf16"],
    },
    "trl_sft": {
        "prompt_completion": ["--per-device-batch-size", "2"],
        "chat_packed": ["--per-device-batch-size", "2", "--data", "chat", "--packing"],
        "padding_free": ["--per-device-batch-size", "2", "--padding-free"],
    },
    "trl_dpo": {
        "full": ["--per-device-batch-size", "2"],
        "lora": ["--per-device-batch-size", "2", "--lora"],
    },
}
"""Each script's runs: their own arguments. A run whose micro-batches hold several rows is run again
with the rows reversed; bf16 (held to a stated bound) and packed or padding-free rows (one row a
micro-batch) are not."""
ONE_ROW = ("--bf16", "--packing", "--padding-free")
METRICS = ("rewards/margins", "rewards/chosen", "rewards/rejected")
"""Logged per step besides the loss and gradient norm, where the trainer logs them (DPO)."""
SEED = 42
PEERS = {
    "nd_parallel_trainer": ("transformers", "accelerate", "torch"),
    "nd_parallel_trainer_moe": ("transformers", "accelerate", "torch"),
    "trainer_features": ("transformers", "accelerate", "torch"),
    "trl_sft": ("trl", "transformers", "accelerate", "torch"),
    "trl_dpo": ("trl", "transformers", "accelerate", "peft", "torch"),
}


def peer_script(script: Path) -> types.ModuleType:
    """``script`` with transformers' and Accelerate's imports, as a module."""
    text = script.read_text()
    for ours, theirs in PEER_IMPORTS.items():
        text = text.replace(ours, theirs)
    left = [line for line in text.splitlines() if line.startswith(("from ndparallel", "import ndparallel"))]
    if left:
        raise SystemExit(f"{script}: no peer import known for {left}")
    # nd_parallel_trainer's `from nd_utils import get_dataset`, the others' `from sft_fixtures import ...`
    sys.path[:0] = [str(script.parent), str(REPO / "tests")]
    module = types.ModuleType(f"{script.stem}_peer")
    exec(compile(text, str(script), "exec"), module.__dict__)
    return module


DATA_FUNCTIONS = {
    "nd_parallel_trainer": "get_dataset",
    "nd_parallel_trainer_moe": "get_dataset",
    "trainer_features": "rows",
    "trl_sft": "dataset",
    "trl_dpo": "dataset",
}
"""The function each script builds its data sets with (re-ordered for the second way)."""


def reversed_rows(get_dataset, batch: int):
    """``get_dataset`` re-ordered so that each batch of the seeded sampler comes out reversed."""

    def wrapped(*args, **kwargs):
        import torch

        dataset = get_dataset(*args, **kwargs)
        order = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(SEED)).tolist()
        index = list(range(len(dataset)))
        for start in range(0, len(order), batch):
            chunk = order[start : start + batch]
            for position, source in zip(chunk, reversed(chunk)):
                index[position] = source
        return dataset.select(index)

    return wrapped


def child(name: str, model_dir: str, run: str, reverse: bool, out: str) -> None:
    import torch

    torch.set_num_threads(1)
    module = peer_script(SCRIPTS[name])
    own = RUNS[name][run]
    batch = int(own[own.index("--per-device-batch-size") + 1])
    if reverse:
        data = DATA_FUNCTIONS[name]
        setattr(module, data, reversed_rows(getattr(module, data), batch))
    with tempfile.TemporaryDirectory() as save:
        result = module.main(["--model-name", model_dir, "--save-dir", save, *COMMON[name], *own])
    history = result if isinstance(result, list) else result["history"]
    steps = [h for h in history if "loss" in h and "grad_norm" in h]
    recorded = {
        "losses": [h["loss"] for h in steps],
        "grad_norms": [h["grad_norm"] for h in steps],
        "learning_rates": [h["learning_rate"] for h in steps],
        "eval_losses": [h["eval_loss"] for h in history if "eval_loss" in h],
        **{m: [h[m] for h in steps] for m in METRICS if steps and m in steps[0]},
    }
    if isinstance(result, dict):
        recorded["callback_steps"] = result["callback_steps"]
    Path(out).write_text(json.dumps(recorded))


def run_peer(name: str, model_dir: Path, run: str, reverse: bool, work: Path) -> dict:
    out = work / f"{name}-{run}{'-reversed' if reverse else ''}.json"
    env = {
        **os.environ,
        "CUDA_VISIBLE_DEVICES": "",
        "HF_HUB_OFFLINE": "1",
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "OMP_NUM_THREADS": "1",
    }
    command = [sys.executable, __file__, "--child", name, str(model_dir), run, str(int(reverse)), str(out)]
    subprocess.run(command, env=env, check=True, cwd=work)
    return json.loads(out.read_text())


def _builder(name: str) -> str:
    return MODELS.get(name, "tiny_llama_dir")


def record(name: str, model_dir: Path, work: Path) -> dict:
    """Every run of one script (and the second way of those with several rows a batch)."""
    from transformers import AutoModelForCausalLM

    from sft_fixtures import weights_checksum

    runs = {}
    for run, own in RUNS[name].items():
        batch = int(own[own.index("--per-device-batch-size") + 1])
        runs[run] = {"first": run_peer(name, model_dir, run, False, work)}
        if batch > 1 and not set(ONE_ROW) & set(own):
            runs[run]["reversed_rows"] = run_peer(name, model_dir, run, True, work)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    return {
        "recorded": datetime.date.today().isoformat(),
        "by": "bench/peers/hf_trainer.py",
        "script": str(SCRIPTS[name].relative_to(REPO)),
        "peers": {p: importlib.metadata.version(p) for p in PEERS[name]},
        "model": {
            "builder": f"tests/sft_fixtures.py {_builder(name)}",
            "checksum": weights_checksum(model_dir),
        },
        "n_params": sum(p.numel() for p in model.parameters()),
        "argv": COMMON[name],
        "run_argv": RUNS[name],
        "runs": runs,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out-dir", type=Path, default=FIXTURES)
    parser.add_argument("--scripts", nargs="*", default=list(SCRIPTS), choices=list(SCRIPTS))
    parser.add_argument("--child", nargs=5, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        name, model_dir, run, reverse, out = args.child
        child(name, model_dir, run, reverse == "1", out)
        return

    sys.path.insert(0, str(REPO / "tests"))
    import sft_fixtures

    args.out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for name in args.scripts:
            model_dir = work / _builder(name)
            if not model_dir.exists():
                getattr(sft_fixtures, _builder(name))(model_dir)
            fixture = record(name, model_dir, work)
            path = args.out_dir / f"{name}.json"
            path.write_text(json.dumps(fixture, indent=1) + "\n")
            for run, result in fixture["runs"].items():
                print(name, run, {k: v["losses"] for k, v in result.items()})
            print(f"wrote {path}")


if __name__ == "__main__":
    main()
