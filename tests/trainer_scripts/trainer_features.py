"""A transformers ``Trainer`` script that uses the Trainer's own features: gradient accumulation,
``max_steps`` or epochs, ``logging_steps``, evaluation on an eval set, ``save_steps`` and
``resume_from_checkpoint``, ``save_model``, a ``report_to`` tracker, a callback, bf16, ``use_cpu``.
Only the two imports marked ``was:`` are ndparallel's; ``bench/peers/hf_trainer.py`` runs it with
them put back, as transformers' own Trainer on Accelerate, for the fixture the door is tested
against. The data: rows of random tokens whose first tokens (a "prompt" of varied length) are not
trained (labels -100), so the ranks of a layout hold different numbers of loss tokens."""

from __future__ import annotations

import argparse

import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, TrainerCallback

from ndparallel.transformers import Trainer, TrainingArguments  # was: from transformers import ...
from ndparallel.utils import ParallelismConfig  # was: from accelerate.utils import ParallelismConfig


class StepRecorder(TrainerCallback):
    """The optimizer steps a callback saw end."""

    def __init__(self):
        self.steps: list[int] = []

    def on_step_end(self, args, state, control, **kwargs):
        self.steps.append(state.global_step)


def rows(n: int, seq_len: int, vocab: int, seed: int) -> Dataset:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (n, seq_len), generator=g)
    labels = ids.clone()
    for i, prompt in enumerate(torch.randint(1, seq_len // 2, (n,), generator=g).tolist()):
        labels[i, :prompt] = -100
    return Dataset.from_dict({"input_ids": ids.tolist(), "labels": labels.tolist()})


def parse_args(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--model-name", required=True)
    parser.add_argument("--save-dir", required=True)
    parser.add_argument("--per-device-batch-size", type=int, default=1)
    parser.add_argument("--gradient-accumulation-steps", type=int, default=2)
    parser.add_argument("--max-steps", type=int, default=4)
    parser.add_argument("--num-train-epochs", type=float, default=1)
    parser.add_argument("--rows", type=int, default=48)
    parser.add_argument("--sequence-length", type=int, default=32)
    parser.add_argument("--learning-rate", type=float, default=0.1)
    parser.add_argument("--logging-steps", type=int, default=1)
    parser.add_argument("--eval-steps", type=int, default=2)
    parser.add_argument("--save-steps", type=int, default=2)
    parser.add_argument("--resume", default=None)
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--report-to", default="none")
    return parser.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    model = AutoModelForCausalLM.from_pretrained(args.model_name)
    vocab = model.config.vocab_size
    training_args = TrainingArguments(
        output_dir=args.save_dir,
        parallelism_config=ParallelismConfig(),  # the sizes from PARALLELISM_CONFIG_* (the launcher's)
        per_device_train_batch_size=args.per_device_batch_size,
        per_device_eval_batch_size=1,
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        max_steps=args.max_steps,
        num_train_epochs=args.num_train_epochs,
        learning_rate=args.learning_rate,
        lr_scheduler_type="constant",
        optim="sgd",  # with momentum: optimizer state to checkpoint; SGD: rounding stays rounding
        optim_args="momentum=0.9",
        logging_steps=args.logging_steps,
        eval_strategy="steps",
        eval_steps=args.eval_steps,
        save_steps=args.save_steps,
        bf16=args.bf16,
        report_to=args.report_to,
        use_cpu=True,
        seed=42,
        remove_unused_columns=False,
    )
    recorder = StepRecorder()
    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=rows(args.rows, args.sequence_length, vocab, seed=1),
        eval_dataset=rows(4, args.sequence_length, vocab, seed=2),
        callbacks=[recorder],
    )
    trainer.train(resume_from_checkpoint=args.resume)
    trainer.save_model()
    return {"history": trainer.state.log_history, "callback_steps": recorder.steps}


if __name__ == "__main__":
    main()
