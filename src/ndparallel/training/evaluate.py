"""Validation loss and perplexity, token-weighted over the whole validation split (any layout),
with the same loss as training (chunked where exact: no full logits)."""

from __future__ import annotations

import math

import torch

from ndparallel.data import PackedLoader
from ndparallel.data.padded import padded_to
from ndparallel.engine import batch_to_device
from ndparallel.engine.step import evaluation


def validation_loader(
    engine,
    val_blocks,
    micro_batch_size: int,
    seed: int,
    pad_to_multiple: int | None = None,
    buckets: tuple[int, ...] | None = None,
):
    """The validation split's loader, every row of it: the rows are padded with rows that train
    nothing to a whole number of global micro-batches (``data.padded``), so a split smaller than one
    global micro-batch is evaluated as a partial batch, and none is dropped."""

    rows = padded_to(val_blocks, engine.dp_size * micro_batch_size)
    return PackedLoader(
        rows,
        micro_batch_size,
        dp_rank=engine.dp_rank,
        dp_size=engine.dp_size,
        seed=seed,
        shuffle=False,
        pad_to_multiple=pad_to_multiple,
        buckets=buckets,
    )


def evaluate(engine, model, loader) -> dict:
    """Loss over every validation block (sharded over the dp ranks), as one device computes it:
    the sum of token losses / the number of label tokens."""
    with evaluation(model):
        # label tokens counted on the host batches (one small collective), then one micro-batch at
        # a time on the device (under pipeline parallel: a pipeline's worth at a time)
        n_items = engine.global_num_items(loader.micro_batch(i) for i in range(len(loader)))
        total = torch.zeros((), device=engine.device)
        pipeline = engine.pipeline_of(model)
        if pipeline is not None:
            group = pipeline.eval_group()
            for start in range(0, len(loader), group):
                mbs = [
                    batch_to_device(loader.micro_batch(i), engine.device)
                    for i in range(start, min(start + group, len(loader)))
                ]
                total += pipeline.evaluate(mbs, n_items, group)
        else:
            for i in range(len(loader)):
                mb = batch_to_device(loader.micro_batch(i), engine.device)
                with engine.batch_context(mb):
                    total += engine.forward_loss(model, mb, n_items).float()
        engine.reduce_step_loss(total)
    loss = float(total)
    return {"eval_loss": loss, "eval_perplexity": math.exp(min(loss, 50.0))}
