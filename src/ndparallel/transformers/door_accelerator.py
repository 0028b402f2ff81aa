"""The Accelerator a door Trainer holds, built from its ``TrainingArguments`` (what it cannot honour
is refused first: ``door_refusals``).

``TrainerAccelerator`` is ndparallel's ``Accelerator`` with the two calls transformers' Trainer
makes that the facade refuses to scripts: ``prepare_model(..., evaluation_mode=True)`` (the Trainer
evaluating before it trains, or a model transformers sharded at load time) prepares the model as for
training — sharded, the same forward — and a model the engine already parallelised is registered
again rather than sharded twice (the Trainer calls ``free_memory`` at the start of every training).
For a trainer whose loss needs whole sequences, each model it prepares splits the sequence of each
call itself (``door_whole_sequences``)."""

from __future__ import annotations

import dataclasses

import torch.nn as nn

from ndparallel.accelerator import Accelerator
from ndparallel.accelerator.plugins import DataLoaderConfiguration, TorchDynamoPlugin
from ndparallel.accelerator.preparing import register_model
from ndparallel.parallel.options import TPOptions
from ndparallel.transformers.door_refusals import refuse_per_rank_token_counts, refuse_unsupported
from ndparallel.transformers.door_whole_sequences import WholeSequenceCalls


class TrainerAccelerator(Accelerator):
    """ndparallel's ``Accelerator`` as transformers' ``Trainer`` drives it."""

    whole_sequence_calls: WholeSequenceCalls | None = None
    """Set for a trainer whose loss needs whole sequences, on a layout that splits or pads them."""

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
        model = super().prepare_model(model, adapter=adapter, quantization=quantization)
        if self.whole_sequence_calls is not None:
            self.whole_sequence_calls.register(model)
        return model


def build_accelerator(args, model: nn.Module | None, whole_sequences: bool = False) -> TrainerAccelerator:
    """The door's Accelerator for ``args`` (the Trainer accumulates gradients itself: its
    accumulation plugin counts 1 micro-batch per step, as transformers' own Trainer sets it).
    ``whole_sequences``: the trainer's loss needs whole sequences (``WholeSequenceCalls``)."""
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
    sequence_parallel = bool(pc is not None and pc.tp_handler is not None and pc.tp_handler.sequence_parallel)
    accelerator = TrainerAccelerator(
        mixed_precision=args.mixed_precision,
        cpu=args.use_cpu,
        dataloader_config=dataloader_config,
        dynamo_plugin=dynamo,
        parallelism_config=None if pc is None else dataclasses.replace(pc),
        # full logits wherever a subclass asks the model for them; the Trainer's own loss is the
        # engine's chunked loss, vocab-parallel under TP whatever this says
        tp_options=TPOptions(loss_parallel=False, sequence_parallel=sequence_parallel),
        timeout_s=float(args.ddp_timeout),
    )
    refuse_per_rank_token_counts(args, accelerator.engine.dims)
    calls = WholeSequenceCalls(accelerator) if whole_sequences else None
    if calls is not None and calls.needed:
        accelerator.whole_sequence_calls = calls
    return accelerator
