"""A TRL DPO script: preference pairs (prompt, chosen, rejected), the reference model TRL builds from
the policy's path (prepared like the policy: sharded on the same layout) or, with ``--lora``, the
adapter-disabled base of a LoRA policy. Only the import marked ``was:`` is ndparallel's;
``bench/peers/hf_trainer.py`` runs it with TRL's own import put back, in one process."""

from __future__ import annotations

import argparse

from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer

from ndparallel.trl import DPOConfig, DPOTrainer  # was: from trl import DPOConfig, DPOTrainer
from ndparallel.utils import ParallelismConfig  # was: from accelerate.utils import ParallelismConfig
from sft_fixtures import alpaca_records


def dataset(n: int) -> Dataset:
    records = alpaca_records(2 * n, seed=5)
    return Dataset.from_list(
        [
            {"prompt": a["instruction"], "chosen": " " + a["output"], "rejected": " " + b["output"]}
            for a, b in zip(records[:n], records[n:])
        ]
    )


def parse_args(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--model-name", required=True)
    parser.add_argument("--save-dir", required=True)
    parser.add_argument("--per-device-batch-size", type=int, default=2)
    parser.add_argument("--max-steps", type=int, default=3)
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--lora", action="store_true")
    parser.add_argument("--save-model", action="store_true", help="trainer.save_model() into --save-dir")
    return parser.parse_args(argv)


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    config = DPOConfig(
        output_dir=args.save_dir,
        parallelism_config=ParallelismConfig(),
        per_device_train_batch_size=args.per_device_batch_size,
        max_steps=args.max_steps,
        learning_rate=0.1,
        lr_scheduler_type="constant",
        optim="sgd",
        logging_steps=1,
        save_strategy="no",
        bf16=False,
        use_cpu=True,
        seed=42,
        max_length=64,
        beta=0.5,
        report_to="none",
    )
    peft_config = None
    if args.lora:
        from peft import LoraConfig

        peft_config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"])
    trainer = DPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(args.model_name),
        args=config,
        train_dataset=dataset(args.rows),
        processing_class=AutoTokenizer.from_pretrained(args.model_name),
        peft_config=peft_config,
    )
    trainer.train()
    if args.save_model:
        trainer.save_model()
    return trainer.state.log_history


if __name__ == "__main__":
    main()
