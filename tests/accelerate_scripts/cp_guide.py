"""The training loop of Accelerate's context-parallel guide ("Context Parallel in accelerate"),
our own copy written to the same API, only the imports changed: the CP strategy set through
``TorchContextParallelConfig(cp_comm_strategy="alltoall")``, the batch sharded by
``maybe_context_parallel`` with input_ids, attention_mask and (pre-shifted) labels, and **no
position_ids** passed to the model."""

import torch
from torch.utils.data import DataLoader
from transformers import AutoModelForCausalLM

from ndparallel import Accelerator  # was: from accelerate import Accelerator
from ndparallel.utils import (  # was: accelerate.utils
    ParallelismConfig,
    TorchContextParallelConfig,
)

from .nd_utils import get_dataset, setup_tokenizer


def collate(rows):
    input_ids = torch.tensor([r["input_ids"] for r in rows])
    shift_labels = torch.tensor([r["shift_labels"] for r in rows])
    return {
        "input_ids": input_ids,
        "attention_mask": torch.ones_like(input_ids),
        "shift_labels": shift_labels,
        "labels": shift_labels,
    }


def run(
    model_name: str,
    sizes: dict,
    steps: int,
    seq_len: int,
    lr: float,
    strategy: str = "alltoall",
    local_positions: bool = False,
):
    """``local_positions``: a deliberately wrong variant passing each shard's *local* positions
    (what a model computes by itself from a shard), to show that positions matter."""
    cp_config = TorchContextParallelConfig(cp_comm_strategy=strategy)
    parallelism_config = ParallelismConfig(
        cp_size=sizes["cp_size"], dp_shard_size=sizes.get("dp_shard_size", 1), cp_handler=cp_config
    )
    accelerator = Accelerator(parallelism_config=parallelism_config)
    model = AutoModelForCausalLM.from_pretrained(model_name, dtype=torch.float32)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    dataset = get_dataset(setup_tokenizer(model_name), seq_len, accelerator)
    dataloader = DataLoader(dataset, batch_size=1, collate_fn=collate)
    model, optimizer, dataloader = accelerator.prepare(model, optimizer, dataloader)

    losses = []
    for step, batch in enumerate(dataloader):
        if step >= steps:
            break
        with accelerator.maybe_context_parallel(
            buffers=[batch["input_ids"], batch["attention_mask"], batch["shift_labels"]],
            buffer_seq_dims=[1, 1, 1],
            no_restore_buffers={batch["input_ids"], batch["labels"]},
        ):
            extra = {}
            if local_positions:
                extra["position_ids"] = torch.arange(batch["input_ids"].shape[1]).unsqueeze(0)
            outputs = model(**batch, **extra)
            loss = outputs.loss
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        losses.append(float(accelerator.reduce(loss.detach(), "mean")))
    return losses
