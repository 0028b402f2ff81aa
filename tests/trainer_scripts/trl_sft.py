"""A TRL SFT script: prompt/completion data (``completion_only_loss``) or chat data, optionally packed.
Only the import marked ``was:`` is ndparallel's; ``bench/peers/hf_trainer.py`` runs it with TRL's own
import put back, in one process, for the fixture the door is tested against. The sizes of a layout
come from the ``PARALLELISM_CONFIG_*`` environment variables (``ParallelismConfig()``)."""

from __future__ import annotations

import argparse

from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer

from ndparallel.trl import SFTConfig, SFTTrainer  # was: from trl import SFTConfig, SFTTrainer
from ndparallel.utils import ParallelismConfig  # was: from accelerate.utils import ParallelismConfig
from sft_fixtures import alpaca_records, chat_records


def dataset(kind: str, n: int) -> Dataset:
    if kind == "chat":
        return Dataset.from_list(chat_records(n, seed=3))
    rows = [
        {"prompt": f"{r['instruction']} {r['input']}".strip(), "completion": " " + r["output"]}
        for r in alpaca_records(n, seed=3)
    ]
    return Dataset.from_list(rows)


def parse_args(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--model-name", required=True)
    parser.add_argument("--save-dir", required=True)
    parser.add_argument("--data", choices=["prompt_completion", "chat"], default="prompt_completion")
    parser.add_argument("--packing", action="store_true")
    parser.add_argument("--padding-free", action="store_true")
    parser.add_argument("--per-device-batch-size", type=int, default=2)
    parser.add_argument("--gradient-accumulation-steps", type=int, default=1)
    parser.add_argument("--max-steps", type=int, default=3)
    parser.add_argument("--max-length", type=int, default=64)
    parser.add_argument("--rows", type=int, default=32)
    return parser.parse_args(argv)


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    config = SFTConfig(
        output_dir=args.save_dir,
        parallelism_config=ParallelismConfig(),
        per_device_train_batch_size=args.per_device_batch_size,
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        max_steps=args.max_steps,
        learning_rate=0.1,
        lr_scheduler_type="constant",
        optim="sgd",
        logging_steps=1,
        save_strategy="no",
        bf16=False,
        use_cpu=True,
        seed=42,
        max_length=None if args.padding_free and not args.packing else args.max_length,
        packing=args.packing,
        padding_free=args.padding_free,
        report_to="none",
    )
    trainer = SFTTrainer(
        model=AutoModelForCausalLM.from_pretrained(args.model_name),
        args=config,
        train_dataset=dataset(args.data, args.rows),
        processing_class=AutoTokenizer.from_pretrained(args.model_name),
    )
    trainer.train()
    return trainer.state.log_history


if __name__ == "__main__":
    main()
