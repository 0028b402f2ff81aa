"""The ND-parallel blog's snippet ("Accelerate ND-Parallel: A guide to Efficient Multi-GPU
Training"), our own copy written to the same API, only the imports changed, followed by the
canonical Accelerate loop with gradient accumulation (``accumulate`` + ``optimizer.step()`` on every
micro-batch) and the Accelerate way of saving (``unwrap_model(...).save_pretrained(...,
state_dict=accelerator.get_state_dict(model))``)."""

import torch
from torch.utils.data import DataLoader
from transformers import AutoModelForCausalLM

from ndparallel import Accelerator  # was: from accelerate import Accelerator
from ndparallel.parallelism_config import (
    ParallelismConfig,  # was: accelerate.parallelism_config
)
from ndparallel.utils import FullyShardedDataParallelPlugin  # was: accelerate.utils

from .nd_utils import create_collate_fn, get_dataset, setup_tokenizer


def run(model_name: str, sizes: dict, save_dir: str, steps: int, seq_len: int, lr: float, grad_accum: int):
    pc = ParallelismConfig(
        dp_shard_size=sizes.get("dp_shard_size", 1),
        dp_replicate_size=sizes.get("dp_replicate_size", 1),
        cp_size=sizes.get("cp_size", 1),
        tp_size=sizes.get("tp_size", 1),
    )
    fsdp_plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2,
        auto_wrap_policy="transformer_based_wrap",
        transformer_cls_names_to_wrap=["LlamaDecoderLayer"],
        state_dict_type="SHARDED_STATE_DICT",
    )
    accelerator = Accelerator(
        parallelism_config=pc, fsdp_plugin=fsdp_plugin, gradient_accumulation_steps=grad_accum
    )
    model = AutoModelForCausalLM.from_pretrained(
        model_name, device_mesh=accelerator.torch_device_mesh, dtype=torch.float32
    )
    model = accelerator.prepare(model)

    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    dataset = get_dataset(setup_tokenizer(model_name), seq_len, accelerator)
    loader = DataLoader(dataset, batch_size=1, collate_fn=create_collate_fn())
    optimizer, loader = accelerator.prepare(optimizer, loader)

    losses, micro = [], []
    for i, batch in enumerate(loader):
        if i >= steps * grad_accum:
            break
        batch["position_ids"] = torch.arange(batch["input_ids"].shape[1]).unsqueeze(0)
        buffers = [batch["input_ids"], batch["shift_labels"], batch["labels"], batch["position_ids"]]
        with (
            accelerator.accumulate(model),
            accelerator.maybe_context_parallel(
                buffers=buffers, buffer_seq_dims=[1, 1, 1, 1], no_restore_buffers=set(buffers)
            ),
        ):
            loss = model(**batch).loss
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        micro.append(loss.detach())
        if accelerator.sync_gradients:
            # mean over all ranks = over the dp × cp ranks that hold different tokens (tp peers: copies)
            losses.append(float(accelerator.reduce(torch.stack(micro).mean(), "mean")))
            micro = []

    accelerator.unwrap_model(model).save_pretrained(
        save_dir,
        state_dict=accelerator.get_state_dict(model),
        is_main_process=accelerator.is_main_process,
    )
    accelerator.wait_for_everyone()
    return losses
