"""Our own copy of Accelerate's ``examples/torch_native_parallelism/nd_parallel.py``, written to the
same API. The only changes that matter are the imports (``accelerate`` -> ``ndparallel``); besides
them: ``train`` returns the per-step losses (for the test), and a few hard-coded choices are
arguments (learning rate, dtype / mixed precision, trackers, and ``--no-transformers-tp``, which
loads the model without transformers' own TP so that ``prepare`` shards it: transformers 5 cannot
do TP on a world larger than tp)."""

import argparse
import warnings

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader
from transformers import AutoModelForCausalLM

from ndparallel import Accelerator  # was: from accelerate import Accelerator
from ndparallel.parallelism_config import (
    ParallelismConfig,  # was: accelerate.parallelism_config
)
from ndparallel.utils import (  # was: accelerate.utils
    FullyShardedDataParallelPlugin,
    set_seed,
)

try:
    from .nd_utils import (
        PerformanceTracker,
        create_collate_fn,
        get_dataset,
        get_model_flops_per_token,
        setup_tokenizer,
    )
except ImportError:  # run as a script
    from nd_utils import (
        PerformanceTracker,
        create_collate_fn,
        get_dataset,
        get_model_flops_per_token,
        setup_tokenizer,
    )


def parse_args(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--dp-replicate-size", type=int, default=1)
    parser.add_argument("--dp-shard-size", type=int, default=1)
    parser.add_argument("--tp-size", type=int, default=1)
    parser.add_argument("--cp-size", type=int, default=1)
    parser.add_argument("--sequence-length", type=int, default=1024)
    parser.add_argument("--num-steps", type=int, default=1000)
    parser.add_argument("--save-dir", type=str, default="./outputs")
    parser.add_argument("--checkpoint-frequency", type=int, default=100)
    parser.add_argument("--model-name", type=str, required=True)
    parser.add_argument("--learning-rate", type=float, default=1e-5)
    parser.add_argument("--dtype", type=str, default="bfloat16")
    parser.add_argument("--mixed-precision", type=str, default="bf16")
    parser.add_argument("--log-with", type=str, nargs="*", default=["wandb"])
    parser.add_argument("--no-transformers-tp", action="store_true")
    return parser.parse_args(argv)


def forward(model, batch, optimizer, accelerator: Accelerator):
    batch["position_ids"] = torch.arange(
        0, batch["input_ids"].size(1), device=batch["input_ids"].device
    ).unsqueeze(0)
    buffers = [batch["input_ids"], batch["shift_labels"], batch["labels"], batch["position_ids"]]
    with accelerator.maybe_context_parallel(
        buffers=buffers, buffer_seq_dims=[1, 1, 1, 1], no_restore_buffers=set(buffers)
    ):
        loss_reduce_grp = (
            accelerator.torch_device_mesh["dp_cp"].get_group()
            if accelerator.parallelism_config.dp_cp_dim_names
            else None
        )
        outputs = model(**batch)
        loss = outputs.loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
        dist.all_reduce(loss, op=dist.ReduceOp.AVG, group=loss_reduce_grp)

    return loss


def train(args):
    parallelism_config = ParallelismConfig(
        dp_replicate_size=args.dp_replicate_size,
        dp_shard_size=args.dp_shard_size,
        tp_size=args.tp_size,
        cp_size=args.cp_size,
    )

    fsdp2_plugin = None
    if parallelism_config.dp_shard_enabled or parallelism_config.cp_enabled:
        fsdp2_plugin = FullyShardedDataParallelPlugin(
            fsdp_version=2,
            auto_wrap_policy="transformer_based_wrap",
            transformer_cls_names_to_wrap=["LlamaDecoderLayer"],
            state_dict_type="SHARDED_STATE_DICT",
        )

    accelerator = Accelerator(
        log_with=args.log_with,
        mixed_precision=args.mixed_precision,
        parallelism_config=parallelism_config,
        fsdp_plugin=fsdp2_plugin,
        project_dir=args.save_dir,
    )
    accelerator.init_trackers("nd_parallel_training")

    model_kwargs = (
        {"tp_size": args.tp_size, "tp_plan": "auto", "device_mesh": accelerator.torch_device_mesh}
        if args.tp_size > 1 and not args.no_transformers_tp
        else {}
    )
    model = AutoModelForCausalLM.from_pretrained(
        args.model_name,
        dtype=getattr(torch, args.dtype),
        use_cache=False,
        **model_kwargs,
    )
    tokenizer = setup_tokenizer(args.model_name)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.learning_rate)
    dataset = get_dataset(tokenizer, args.sequence_length, accelerator)
    dataloader = DataLoader(dataset, batch_size=1, collate_fn=create_collate_fn())

    model, optimizer, dataloader = accelerator.prepare(model, optimizer, dataloader)

    total_num_steps = min(args.num_steps, len(dataloader))
    performance_tracker = PerformanceTracker(warmup_steps=5)
    model_flops_per_token = get_model_flops_per_token(model, args.sequence_length)

    accelerator.print("Starting training...")
    losses = []
    for step, batch in enumerate(dataloader):
        if step >= total_num_steps:
            break

        loss = forward(model, batch, optimizer, accelerator)
        losses.append(loss.item())

        metrics = performance_tracker.step(
            batch["input_ids"].shape[1] / parallelism_config.non_data_parallel_size, model_flops_per_token
        )
        print_msg = f"Step {step}/{total_num_steps}, Loss: {loss.item():.4f}"
        if "warmup_completed" in metrics:
            accelerator.print("Warm up completed! Starting performance tracking...")
        elif metrics:
            print_msg += performance_tracker.get_print_message(metrics, with_memory=True)
        if step % 10 == 0 or step == total_num_steps - 1:
            accelerator.print(print_msg)

        if step % args.checkpoint_frequency == 0 and step > 0 and parallelism_config.dp_shard_enabled:
            accelerator.print(f"Saving checkpoint at step {step}...")
            accelerator.save_state(args.save_dir + f"/checkpoint-{step}")

        accelerator.log({"loss": loss.item()})

    accelerator.print("Training completed!")

    model.save_pretrained(args.save_dir + "/final")
    accelerator.print(f"Model saved to {args.save_dir}/final")
    accelerator.end_training()
    return losses


def main(argv=None):
    set_seed(42)
    args = parse_args(argv)
    if args.dp_shard_size == 1 and args.tp_size > 1:
        warnings.warn(
            "pure tensor parallel: intermediate checkpoints are only saved with dp_shard_size > 1",
            stacklevel=2,
        )
    return train(args)


if __name__ == "__main__":
    main()
