"""Our own copy of Accelerate's ``examples/torch_native_parallelism/nd_parallel_trainer.py``, written
to the same API. What matters are the two import lines marked ``was:`` (transformers' ``Trainer`` and
``TrainingArguments``, Accelerate's ``ParallelismConfig`` -> ndparallel's); ``bench/peers/hf_trainer.py``
runs this very file with those lines put back, as transformers' own Trainer on Accelerate.

Besides them: transformers 5 has no ``infer_device`` export and no ``Trainer(tokenizer=...)``
(``processing_class=``); what the upstream script hard-codes for an 8B model on GPUs is an argument
here, so a test can run it small (batch size, learning rate, steps, precision, optimizer, logging,
checkpoints); ``main`` returns the trainer's log history."""

import argparse

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from ndparallel.transformers import Trainer, TrainingArguments  # was: from transformers import ...
from ndparallel.utils import ParallelismConfig  # was: from accelerate.utils import ParallelismConfig

try:
    from .nd_utils import get_dataset
except ImportError:  # run as a script
    from nd_utils import get_dataset

MODEL_ID = "NousResearch/Hermes-3-Llama-3.1-8B"


def parse_args(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--sequence-length", type=int, default=4096)
    parser.add_argument("--checkpoint-frequency", type=int, default=100)
    parser.add_argument("--model-name", type=str, default=MODEL_ID)
    parser.add_argument("--save-dir", type=str, default=f"./accelerate-nd-parallel-{MODEL_ID.split('/')[-1]}")
    parser.add_argument("--device-type", type=str, default="auto")
    parser.add_argument("--per-device-batch-size", type=int, default=1)
    parser.add_argument("--learning-rate", type=float, default=5e-5)
    parser.add_argument("--max-steps", type=int, default=-1)
    parser.add_argument("--logging-steps", type=int, default=5)
    parser.add_argument("--optim", type=str, default="adamw_torch")
    parser.add_argument("--no-bf16", action="store_true")
    parser.add_argument("--use-cpu", action="store_true")
    parser.add_argument("--seed", type=int, default=42)
    return parser.parse_args(argv)


def main(argv=None):
    # If ParallelismConfig is not initialized with __init__, it reads from env vars
    # which were set by using config
    pc = ParallelismConfig()
    args = parse_args(argv)

    if args.device_type == "auto":
        args.device_type = "cuda" if torch.cuda.is_available() and not args.use_cpu else "cpu"

    model_kwargs = {}
    if pc.tp_enabled:
        model_kwargs["tp_plan"] = "auto"
        model_kwargs["device_mesh"] = pc.build_device_mesh(args.device_type)

    tokenizer = AutoTokenizer.from_pretrained(args.model_name)
    model = AutoModelForCausalLM.from_pretrained(args.model_name, use_cache=False, **model_kwargs)

    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token

    packed_dataset = get_dataset(tokenizer, args.sequence_length)

    training_args = TrainingArguments(
        output_dir=args.save_dir,
        parallelism_config=pc,
        num_train_epochs=1,
        max_steps=args.max_steps,
        per_device_train_batch_size=args.per_device_batch_size,
        logging_steps=args.logging_steps,
        save_steps=args.checkpoint_frequency,
        learning_rate=args.learning_rate,
        optim=args.optim,
        remove_unused_columns=False,
        bf16=not args.no_bf16,
        use_cpu=args.use_cpu,
        seed=args.seed,
    )

    trainer = Trainer(
        model=model,
        args=training_args,
        processing_class=tokenizer,
        train_dataset=packed_dataset,
    )

    trainer.train()
    trainer.save_model()
    return trainer.state.log_history


if __name__ == "__main__":
    main()
