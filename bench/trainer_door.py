"""The Trainer door (``ndparallel.transformers.Trainer``) against ndparallel's own ``train`` loop on the
same layout, model and batch shape: tokens/s and peak memory, ratios measured in one run.

    python bench/trainer_door.py [--layout dp_shard_size=2] [--steps 12] [--rounds 2]

Both sides are real launches of ``--nproc-per-node`` ranks on this machine (CPU, gloo unless a GPU
is visible): ``ndparallel train`` on a YAML config (``micro_batch_size`` rows of ``sequence_len``
tokens per rank, AdamW, the chunked loss), and this file's ``--door`` role launched with
``ndparallel launch``, a transformers ``Trainer`` script through the door with the same per-device
batch, sequence length, optimizer and layout. The model (a Llama of ``--hidden`` / ``--layers``,
seeded) is saved once and loaded by both. Per side: the median step time over the steps after
``--warmup`` (``ndparallel train``'s ``metrics.jsonl`` ``step_time_s``; the door's from a callback,
one optimizer step's end to the next), tokens/s from it, and the peak memory per rank (GPU:
allocated; CPU: the process's peak RSS, libraries included). The sides alternate ``--rounds`` times,
which one goes first alternating too; the best round of each counts (the machine is shared), beside
the median of the rounds' ratios (each round's two runs ran back to back).
Goal: tokens/s ≥ 0.95× and peak memory ≤ 1.05× of ``ndparallel train``'s.
Writes ``bench/results/trainer_door-<layout>-<date>.json``."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))


def make_model(path: Path, hidden: int, layers: int) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    sys.path.insert(0, str(REPO / "tests"))
    from sft_fixtures import llama3_tokenizer

    tokenizer = llama3_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=hidden * 8 // 3 // 16 * 16,
        num_hidden_layers=layers,
        num_attention_heads=max(hidden // 64, 2),
        num_key_value_heads=max(hidden // 128, 1),
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)


# ------------------------------------------------------------------------- the door's side (a rank)
def door(args) -> None:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, TrainerCallback

    from ndparallel import ParallelismConfig
    from ndparallel.transformers import Trainer, TrainingArguments

    class StepTimes(TrainerCallback):
        """From one optimizer step's end to the next: data, forward, backward, step, logging (what
        ``ndparallel train``'s ``step_time_s`` covers between two logs)."""

        def __init__(self):
            self.times, self._last = [], None

        def on_step_end(self, *_, **__):
            now = time.perf_counter()
            if self._last is not None:
                self.times.append(now - self._last)
            self._last = now

    model = AutoModelForCausalLM.from_pretrained(args.model)
    rows = args.steps * args.batch * int(os.environ["WORLD_SIZE"]) * 2
    ids = torch.randint(
        1, model.config.vocab_size, (rows, args.seq), generator=torch.Generator().manual_seed(0)
    )
    data = Dataset.from_dict({"input_ids": ids.tolist(), "labels": ids.tolist()})
    times = StepTimes()
    training_args = TrainingArguments(
        output_dir=args.out,
        parallelism_config=ParallelismConfig(),  # the sizes from the environment (the launcher's)
        per_device_train_batch_size=args.batch,
        max_steps=args.steps,
        learning_rate=1e-4,
        optim="adamw_torch",
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        use_cpu=not torch.cuda.is_available(),
        bf16=False,
    )
    trainer = Trainer(model=model, args=training_args, train_dataset=data, callbacks=[times])
    trainer.train()
    peak = _peak_memory_gb()
    peaks = trainer.accelerator.gather(torch.tensor([peak], device=trainer.accelerator.device)).tolist()
    if trainer.accelerator.is_main_process:
        Path(args.out, "door.json").write_text(
            json.dumps({"step_times": times.times, "peak_memory_gb": max(peaks)})
        )


def _peak_memory_gb() -> float:
    import torch

    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


# ---------------------------------------------------------------------------------- the driver
def _env() -> dict:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1", "OMP_NUM_THREADS": "1"}


def run_door(args, layout: dict, work: Path) -> dict:
    out = work / f"door-{time.monotonic_ns()}"
    env = _env() | {f"PARALLELISM_CONFIG_{k.upper()}": str(v) for k, v in layout.items()}
    own = ["--model", str(args.model_dir), "--out", str(out), "--steps", str(args.steps)]
    own += ["--batch", str(args.batch), "--seq", str(args.seq)]
    launch = [sys.executable, "-m", "ndparallel", "launch", f"--nproc-per-node={args.world}"]
    subprocess.run([*launch, __file__, "--door", *own], env=env, check=True, cwd=work)
    result = json.loads((out / "door.json").read_text())
    steps = result["step_times"][args.warmup :]
    return {"step_time_s": statistics.median(steps), "peak_memory_gb": result["peak_memory_gb"]}


def run_train(args, layout: dict, work: Path) -> dict:
    import yaml

    out = work / f"train-{time.monotonic_ns()}"
    config = {
        "base_model": str(args.model_dir),
        "datasets": [{"path": "builtin:stdlib", "max_bytes": 400000}],
        "sequence_len": args.seq,
        "micro_batch_size": args.batch,
        "max_steps": args.steps,
        "learning_rate": 1e-4,
        "optimizer": "adamw_torch",
        "logging_steps": 1,
        "save_steps": None,
        "output_dir": str(out),
        **layout,
    }
    path = work / f"{out.name}.yaml"
    path.write_text(yaml.safe_dump(config))
    command = [sys.executable, "-m", "ndparallel", "train", str(path), f"--nproc-per-node={args.world}"]
    subprocess.run(command, env=_env(), check=True, cwd=work, stdout=subprocess.DEVNULL)
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in metrics if "step_time_s" in m][args.warmup :]
    return {
        "step_time_s": statistics.median(m["step_time_s"] for m in steps),
        "peak_memory_gb": max(m["peak_memory_gb"] for m in steps),
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layout", default="dp_shard_size=2", help="comma-separated sizes")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--door", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.door:
        return door(args)

    from _common import print_table, write_json

    layout = {k: int(v) for k, v in (kv.split("=") for kv in args.layout.split(","))}
    args.world = 1
    for size in layout.values():
        args.world *= size
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        args.model_dir = work / "model"
        make_model(args.model_dir, args.hidden, args.layers)
        rounds = []
        for i in range(args.rounds):  # the order alternates, so a drift of the machine's load cancels
            sides = {"train": run_train, "door": run_door}
            order = ("train", "door") if i % 2 == 0 else ("door", "train")
            measured = {side: sides[side](args, layout, work) for side in order}
            rounds.append({"first": order[0], **measured})
    tokens = args.batch * args.seq * args.world // max(1, layout.get("tp_size", 1) * layout.get("cp_size", 1))
    best = {
        side: min((r[side] for r in rounds), key=lambda m: m["step_time_s"]) for side in ("train", "door")
    }
    ratios = {
        "tokens_per_s": best["train"]["step_time_s"] / best["door"]["step_time_s"],
        "peak_memory": best["door"]["peak_memory_gb"] / best["train"]["peak_memory_gb"],
        # each round's two runs were launched one after the other: the median of their ratios too
        "tokens_per_s_paired_median": statistics.median(
            r["train"]["step_time_s"] / r["door"]["step_time_s"] for r in rounds
        ),
    }
    rows = [
        [side, tokens / best[side]["step_time_s"], best[side]["step_time_s"], best[side]["peak_memory_gb"]]
        for side in ("train", "door")
    ]
    print_table(
        f"Trainer door vs ndparallel train, {args.layout}",
        ["side", "tokens/s", "step s", "peak GB/rank"],
        rows,
    )
    print(
        f"door / train: tokens/s {ratios['tokens_per_s']:.3f} (best rounds; the median of the rounds' "
        f"ratios {ratios['tokens_per_s_paired_median']:.3f}; goal >= 0.95), "
        f"peak memory {ratios['peak_memory']:.3f} (goal <= 1.05)"
    )
    write_json(
        f"trainer_door-{args.layout.replace('=', '').replace(',', '-')}-{datetime.date.today().isoformat()}",
        {
            "layout": layout,
            "args": vars(args) | {"model_dir": None},
            "rounds": rounds,
            "best": best,
            "ratios": ratios,
        },
    )


if __name__ == "__main__":
    main()
