"""The Accelerator a door Trainer holds, built from its ``TrainingArguments`` (what it cannot honour
is refused first: ``door_refusals``).

``TrainerAccelerator`` is ndparallel's ``Accelerator`` with the two calls transformers' Trainer
makes that the facade refuses to scripts: ``prepare_model(..., evaluation_mode=True)`` (the Trainer
evaluating before it trains, or a model transformers sharded at load time) prepares the model as for
training — sharded, the same forward — and a model the engine already parallelised is registered
again rather than sharded twice (the Trainer calls ``free_memory`` at the start of every training)."""

from __future__ import annotations

import dataclasses

import torch.nn as nn

from ndparallel.accelerator import Accelerator
from ndparallel.accelerator.plugins import DataLoaderConfiguration, TorchDynamoPlugin
from ndparallel.accelerator.preparing import register_model
from ndparallel.parallel.options import TPOptions
from ndparallel.transformers.door_refusals import refuse_per_rank_token_counts, refuse_unsupported


class TrainerAccelerator(Accelerator):
    """ndparallel's ``Accelerator`` as transformers' ``Trainer`` drives it."""

    def prepare_model(
        self,
        model: nn.Module,
        device_placement: bool | None = None,
        evaluation_mode: bool = False,
        adapter=None,
        quantization=None,
    ) -> nn.Module:
        if self.engine.record_of(model) is not None:
            return model if any(model is m for m in self._models) else register_model(self, model)
        return super().prepare_model(model, adapter=adapter, quantization=quantization)


def build_accelerator(args, model: nn.Module | None) -> TrainerAccelerator:
    """The door's Accelerator for ``args`` (the Trainer accumulates gradients itself: its
    accumulation plugin counts 1 micro-batch per step, as transformers' own Trainer sets it)."""
    refuse_unsupported(args)
    config = args.accelerator_config
    dataloader_config = DataLoaderConfiguration(
        split_batches=config.split_batches,
        dispatch_batches=config.dispatch_batches,
        even_batches=config.even_batches,
        use_seedable_sampler=config.use_seedable_sampler,
        data_seed=args.seed if args.data_seed is None else args.data_seed,
        non_blocking=config.non_blocking,
    )
    dynamo = TorchDynamoPlugin(backend=args.torch_compile_backend if args.torch_compile else "no")
    pc = args.parallelism_config  # copied: the Accelerator keeps its mesh there, and args are pickled
    accelerator = TrainerAccelerator(
        mixed_precision=args.mixed_precision,
        cpu=args.use_cpu,
        dataloader_config=dataloader_config,
        dynamo_plugin=dynamo,
        parallelism_config=None if pc is None else dataclasses.replace(pc),
        # full logits wherever a subclass asks the model for them; the Trainer's own loss is the
        # engine's chunked loss, vocab-parallel under TP whatever this says
        tp_options=TPOptions(loss_parallel=False),
        timeout_s=float(args.ddp_timeout),
    )
    refuse_per_rank_token_counts(args, accelerator.engine.dims)
    return accelerator
