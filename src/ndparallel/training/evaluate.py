"""Validation loss and perplexity, token-weighted over the whole validation split (any layout),
with the same loss as training (chunked where exact: no full logits)."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from ndparallel.training.step import batch_to_device


def validation_loader(acc, val_blocks, micro_batch_size: int, seed: int, pad_to_multiple: int | None = None):
    """The validation split's loader (built at start, so a split too small for the layout fails
    before training, not hours later at the first evaluation)."""
    from ndparallel.data import PackedLoader

    try:
        return PackedLoader(val_blocks, micro_batch_size, dp_rank=acc.dp_rank, dp_size=acc.dp_size,
                            seed=seed, shuffle=False, pad_to_multiple=pad_to_multiple)
    except ValueError:
        raise ValueError(
            f"val_set_size gives {val_blocks.shape[0]} validation blocks, fewer than one global "
            f"micro-batch (dp_size {acc.dp_size} × micro_batch_size {micro_batch_size}); raise "
            "val_set_size (a fraction, or a number of blocks) or set it to 0") from None


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
