"""Validation loss and perplexity, token-weighted over the whole validation split (any layout),
with the same loss as training (chunked where exact: no full logits)."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from ndparallel.training.step import batch_to_device


def validation_loader(acc, val_blocks, micro_batch_size: int, seed: int, pad_to_multiple: int | None = None):
    """The validation split's loader, every row of it: the rows are padded with rows that train
    nothing to a whole number of global micro-batches (``data.padded``), so a split smaller than one
    global micro-batch is evaluated as a partial batch, and none is dropped."""
    from ndparallel.data import PackedLoader
    from ndparallel.data.padded import padded_to

    rows = padded_to(val_blocks, acc.dp_size * micro_batch_size)
    return PackedLoader(rows, micro_batch_size, dp_rank=acc.dp_rank, dp_size=acc.dp_size,
                        seed=seed, shuffle=False, pad_to_multiple=pad_to_multiple)


@torch.no_grad()
def evaluate(acc, model, loader) -> dict:
    """Loss over every validation block (sharded over the dp ranks), as one device computes it:
    the sum of token losses / the number of label tokens."""
    model.eval()
    micro_batches = range(len(loader))
    # label tokens counted on the host batches (one small collective), then one micro-batch at a
    # time on the device
    n_items = acc.global_num_items(loader.micro_batch(i) for i in micro_batches)
    total = torch.zeros((), device=acc.device)
    for i in micro_batches:
        mb = batch_to_device(loader.micro_batch(i), acc.device)
        with acc.maybe_context_parallel(
            buffers=[mb["input_ids"], mb["shift_labels"], mb["position_ids"]], buffer_seq_dims=[1, 1, 1]
        ):
            total += acc.forward_loss(model, mb, n_items).float()
    dist.all_reduce(total, group=acc.mesh("dp_cp").get_group())
    model.train()
    loss = float(total)
    return {"eval_loss": loss, "eval_perplexity": math.exp(min(loss, 50.0))}
