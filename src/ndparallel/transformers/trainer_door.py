"""The Trainer door: transformers' ``Trainer`` (and any subclass of it) on ndparallel's engine.

``TrainerDoor`` subclasses transformers' ``Trainer`` and overrides its documented extension points
only; ``parallel_trainer(SomeTrainer)`` puts it *under* ``SomeTrainer`` in a new class
(``class SomeTrainer(SomeTrainer, TrainerDoor)``: the MRO is SomeTrainer's own classes, then the door,
then transformers' ``Trainer``), so a subclass's overrides (TRL's ``compute_loss``, its
``training_step`` wrappers) run as written and reach the door where they call ``super()``. Nothing of
transformers or TRL is patched: their classes stay as they are.

What the door replaces, and with what of the engine (through the ``Accelerator``):

* ``create_accelerator_and_postprocess``: ndparallel's ``Accelerator`` for the layout
  (``door_accelerator``) — ``prepare`` then parallelises the model (``parallelize_model``), shards
  the loaders over the dp ranks (seeded by ``data_seed``/``seed``, the order one process sees), and
  its ``backward`` maps the Trainer's gradient averaging onto the engine's sums.
* ``_get_num_items_in_batch``: the engine's global token count (every micro-batch of the step,
  every dp rank, counted before CP splits the sequence).
* ``compute_loss``: for a plain causal-LM batch, the engine's ``forward_loss`` (the chunked loss
  where exact, no full logits), scaled as transformers scales its own; anything else, transformers'.
* ``_prepare_context_parallel_inputs``: the batch made ready for the layout (``door_batches``) and
  split over the cp ranks in ``maybe_context_parallel`` — or, for a trainer whose loss needs whole
  sequences (``splits_sequences=False``), left whole: each model call splits itself
  (``door_whole_sequences``).
* ``_clip_grad_norm`` / ``_get_grad_norm``: the engine's global gradient norm.
* ``get_resumed_dataloader``, ``_sync_replicated_trainable_parameters``, ``_move_model_to_device``:
  the prepared loader's own skip; the engine owns gradient reduction and device placement.
* ``_save``: one consolidated Hugging Face directory written by every rank together.
* ``_save_optimizer_and_scheduler`` / ``_load_optimizer_and_scheduler`` / ``_load_from_checkpoint`` /
  ``_load_best_model``: a checkpoint's model and optimizer as the engine's sharded DCP state
  (``checkpoint-N/ndparallel_state``: any layout resumes it), beside transformers' own files.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os

import torch
import torch.distributed as dist
import transformers
from transformers.trainer import SCHEDULER_NAME, TRAINING_ARGS_NAME

from ndparallel.techniques.loss import IGNORE_INDEX
from ndparallel.transformers.door_accelerator import build_accelerator
from ndparallel.transformers.door_batches import LOSS_KEYS, SEQUENCE_KEYS, layout_inputs, loss_labels

STATE_DIR = "ndparallel_state"
"""A checkpoint's sharded model and optimizer state (``Accelerator.save_state``), in ``checkpoint-N/``."""


class TrainerDoor(transformers.Trainer):
    """transformers' ``Trainer`` with ndparallel's engine underneath (see the module docstring)."""

    splits_sequences: bool = True
    """Whether the trainer's loss survives its batches being split over cp ranks (a sum over tokens
    does). False (a function of whole-sequence sums, DPO's log-probabilities): the batches stay whole
    and each model call splits its sequences and gathers its per-token outputs back
    (``door_whole_sequences``)."""

    # ------------------------------------------------------------------ the accelerator
    def create_accelerator_and_postprocess(self) -> None:
        grad_acc = self.args.accelerator_config.gradient_accumulation_kwargs or {}
        if "num_steps" in grad_acc:
            if self.args.gradient_accumulation_steps > 1:
                raise ValueError(
                    "accelerator_config's gradient_accumulation_kwargs num_steps and "
                    "gradient_accumulation_steps > 1 are both set: keep gradient_accumulation_steps"
                )
            self.args.gradient_accumulation_steps = grad_acc["num_steps"]
        self.accelerator = build_accelerator(self.args, self.model, whole_sequences=not self.splits_sequences)
        self.gather_function = functools.partial(
            self.accelerator.gather_for_metrics, use_gather_object=self.args.eval_use_gather_object
        )
        self.is_deepspeed_enabled = False
        self.is_fsdp_enabled = False  # no FSDP branch of transformers' own: the engine shards every layout

    def _validate_args(self) -> None:
        super()._validate_args()
        engine = self.accelerator.engine
        trl = next((c for c in type(self).__mro__ if c.__module__.startswith("trl.")), None)
        if trl is not None and engine.dims.tp_enabled and engine.options.tp.sequence_parallel:
            raise ValueError(
                f"sequence_parallel is not supported with TRL's {trl.__name__}: its fused LM head reads "
                "the decoder's output, which sequence parallel leaves split over the tp ranks; turn "
                "sequence_parallel off (TorchTensorParallelConfig, NDPARALLEL_SEQUENCE_PARALLEL)"
            )
        cp = engine.dims.cp_enabled
        if self.compute_metrics is not None and cp:
            raise ValueError(
                "compute_metrics needs each evaluation batch's logits, and context parallelism splits "
                "them over the cp ranks: evaluate the loss only (no compute_metrics) or set cp_size=1"
            )
        if cp and (self.compute_loss_func is not None or self.label_smoother is not None):
            what = "compute_loss_func" if self.compute_loss_func is not None else "label_smoothing_factor"
            raise ValueError(
                f"{what} takes the unshifted labels, which context parallelism replaces by labels shifted "
                f"before the split: drop {what} or set cp_size=1"
            )
        # A model transformers sharded at load time (tp_plan / distributed_config) is adopted by
        # prepare like any other: the engine owns its gradient reduction and its checkpoints.
        self.is_distributed_loading_by_transformers = False

    def _move_model_to_device(self, model, device) -> None:
        """Nothing: ``prepare`` builds each rank's shards on the Accelerator's device."""

    def _sync_replicated_trainable_parameters(self, model) -> None:
        """Nothing: every trainable parameter of a prepared model is reduced by the engine."""

    # ----------------------------------------------------------------- the loss
    def _get_num_items_in_batch(self, batch_samples: list, device: torch.device):
        normalised = self.model_accepts_loss_kwargs or self.compute_loss_func is not None
        labels = [loss_labels(b, self._loss_shifts_labels) for b in batch_samples] if normalised else []
        if not labels or any(lab is None for lab in labels):
            return None
        return self.accelerator.global_num_items([{"shift_labels": lab.to(device)} for lab in labels])

    def _loss_scale(self) -> int:
        """What transformers multiplies a token-normalised loss by (its backward then averages over
        the ranks that hold different tokens; the Accelerator's divides by their number)."""
        if not self.args.average_tokens_across_devices:
            return 1
        return self.accelerator.num_processes // self.get_tp_size()

    def _engine_batch(self, inputs, return_outputs: bool, num_items_in_batch) -> dict | None:
        """The batch for the engine's loss, or None where transformers' own loss must run."""
        if (
            return_outputs
            or num_items_in_batch is None
            or self.compute_loss_func is not None
            or self.label_smoother is not None
            or not self._loss_shifts_labels
            or not set(inputs) <= LOSS_KEYS
            or "input_ids" not in inputs
        ):
            return None
        labels = loss_labels(inputs)
        if labels is None:
            return None
        batch = {k: inputs[k] for k in (*SEQUENCE_KEYS, "attention_mask") if inputs.get(k) is not None}
        batch["shift_labels"] = labels
        return batch

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        batch = self._engine_batch(inputs, return_outputs, num_items_in_batch)
        if batch is None:
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        return self.accelerator.forward_loss(model, batch, num_items_in_batch) * self._loss_scale()

    def _prepare_context_parallel_inputs(self, model, inputs):
        engine = self.accelerator.engine
        options = engine.options
        divisor = engine.dims.seq_len_divisor(options.tp.sequence_parallel, options.cp.load_balance)
        if divisor == 1 or "input_ids" not in inputs or not self.splits_sequences:
            return contextlib.nullcontext, inputs
        cp = engine.dims.cp_enabled
        inputs = layout_inputs(inputs, divisor, cp, "the Trainer's batch")
        if not cp:
            return contextlib.nullcontext, inputs
        buffers = [inputs[k] for k in SEQUENCE_KEYS if k in inputs]
        context = functools.partial(
            self.accelerator.maybe_context_parallel,
            buffers=buffers,
            buffer_seq_dims=[1] * len(buffers),
            no_restore_buffers=set(buffers),
        )
        return context, inputs

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        """Under context parallelism the evaluation batch is split like a training batch, and its
        loss (its tokens' mean) is the engine's, summed over the cp ranks; else transformers' own."""
        batch = self._engine_batch(inputs, False, 1)
        if not self.accelerator.engine.dims.cp_enabled or batch is None or not self.splits_sequences:
            return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys)
        count = (batch["shift_labels"] != IGNORE_INDEX).sum()
        context, batch = self._prepare_context_parallel_inputs(model, batch)
        with torch.no_grad(), context():
            loss = self.accelerator.forward_loss(model, self._engine_batch(batch, False, 1), count)
        dist.all_reduce(loss, group=self.accelerator.mesh("cp").get_group())
        return loss.detach(), None, None

    # ------------------------------------------------------------ the optimizer step
    def _clip_grad_norm(self, model):
        return self.accelerator.clip_grad_norm_(model.parameters(), self.args.max_grad_norm)

    def _get_grad_norm(self, model, grad_norm=None):
        return self.accelerator.grad_norm(model.parameters()) if grad_norm is None else grad_norm

    def get_resumed_dataloader(self, dataloader, num_batches: int):
        return self.accelerator.skip_first_batches(dataloader, num_batches)

    # ------------------------------------------------------------------- saving
    def _save(self, output_dir: str | None = None, state_dict=None) -> None:
        """The model as one Hugging Face directory (every rank takes part; rank 0 writes), with the
        processing class and the training arguments, as transformers' ``_save`` writes them."""
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        self.accelerator.save_model(self.model, output_dir)
        if not self.args.should_save:
            return
        saver = self.processing_class or getattr(self.data_collator, "tokenizer", None)
        if saver is not None and hasattr(saver, "save_pretrained"):
            saver.save_pretrained(output_dir)
        torch.save(self.args, os.path.join(output_dir, TRAINING_ARGS_NAME))

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        """The model and optimizer as the engine's sharded state (every rank writes its shards), the
        learning-rate schedule as transformers saves it."""
        self.accelerator.save_state(os.path.join(output_dir, STATE_DIR))
        if self.args.should_save:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        if os.path.isdir(os.path.join(resume_from_checkpoint, STATE_DIR)):
            return  # read with the optimizer once the model is prepared, resharded to this layout
        super()._load_from_checkpoint(resume_from_checkpoint, model)  # its Hugging Face weights only

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None:
            return
        state = os.path.join(checkpoint, STATE_DIR)
        if os.path.isdir(state):
            self.accelerator.load_state(state)
        schedule = os.path.join(checkpoint, SCHEDULER_NAME)
        if os.path.isfile(schedule):
            self.lr_scheduler.load_state_dict(torch.load(schedule, weights_only=True))

    def _load_best_model(self) -> None:
        best = os.path.join(self.state.best_model_checkpoint, STATE_DIR)
        if not os.path.isdir(best):
            raise ValueError(
                f"load_best_model_at_end: {self.state.best_model_checkpoint} holds no {STATE_DIR}/ "
                "(save_only_model=True): leave save_only_model False to reload the best model"
            )
        self.accelerator.load_state(best)


@functools.cache
def parallel_trainer(trainer_class: type, splits_sequences: bool = True) -> type:
    """``trainer_class`` (transformers' ``Trainer`` or a subclass) on ndparallel: a subclass with
    ``TrainerDoor`` under ``trainer_class``'s own overrides. The same class each time it is asked.
    ``splits_sequences=False``: its loss is a function of whole-sequence sums (DPO's), so its batches
    stay whole and each model call splits its sequences over the cp ranks itself."""
    if not (inspect.isclass(trainer_class) and issubclass(trainer_class, transformers.Trainer)):
        raise TypeError(f"parallel_trainer takes a subclass of transformers.Trainer, got {trainer_class!r}")
    if issubclass(trainer_class, TrainerDoor):
        return trainer_class
    if trainer_class is transformers.Trainer:
        return Trainer
    return type(
        trainer_class.__name__,
        (trainer_class, TrainerDoor),
        {"__module__": __name__, "__doc__": trainer_class.__doc__, "splits_sequences": splits_sequences},
    )


class Trainer(TrainerDoor):
    """transformers' ``Trainer`` on ndparallel's engine: ``from ndparallel.transformers import
    Trainer, TrainingArguments`` in place of transformers' (docs/trainer.md)."""
