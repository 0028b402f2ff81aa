"""The training step's Accelerator methods: loss, ``backward``, gradient accumulation (with the
prepared optimizer/scheduler skipping until the step completes), clipping, autocast, profiling."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
import torch.nn as nn

from ndparallel.accelerator.handlers import ProfileKwargs
from ndparallel.engine import batch_to_device
from ndparallel.parallel.fsdp import set_gradient_sync


class SteppingMixin:
    gradient_state: Any

    # ------------------------------------------------------------ accumulation
    @property
    def sync_gradients(self) -> bool:
        """True on the micro-batch that completes an optimizer step."""
        return self.gradient_state.sync_gradients

    @sync_gradients.setter
    def sync_gradients(self, value: bool) -> None:
        self.gradient_state.sync_gradients = bool(value)

    @property
    def gradient_accumulation_steps(self) -> int:
        return self.gradient_state.num_steps

    @gradient_accumulation_steps.setter
    def gradient_accumulation_steps(self, value: int) -> None:
        if int(value) < 1:
            raise ValueError(f"gradient_accumulation_steps must be >= 1, got {value}")
        self.gradient_state.num_steps = int(value)

    def _do_sync(self) -> None:
        state = self.gradient_state
        if state.sync_with_dataloader and state.end_of_dataloader:
            self.step = 0
            state.sync_gradients = True
        else:
            self.step += 1
            state.sync_gradients = self.step % state.num_steps == 0

    @contextlib.contextmanager
    def accumulate(self, *models: nn.Module):
        """One micro-batch of gradient accumulation. On all but the step's last micro-batch the
        prepared optimizer/scheduler do nothing and the replica all-reduce is skipped; gradients are
        still reduce-scattered, so they stay sharded (``FSDPOptions.unsharded_grad_accumulation``
        skips that too). The last batch of a prepared loader always completes a step."""

        self._do_sync()
        sync = self.sync_gradients or (self.use_distributed and self.gradient_state.sync_each_batch)
        keep_rs = not self.fsdp_options.unsharded_grad_accumulation
        targets = models or tuple(self._models)
        for m in targets:
            set_gradient_sync(m, sync, keep_reduce_scatter=keep_rs)
        try:
            yield
        finally:
            for m in targets:
                set_gradient_sync(m, True)

    @contextlib.contextmanager
    def no_sync(self, model: nn.Module):
        """Skip all gradient reduction for the backward passes inside the block (gradients
        accumulate unsharded until a backward outside it)."""

        set_gradient_sync(model, False)
        try:
            yield
        finally:
            set_gradient_sync(model, True)

    @staticmethod
    @contextlib.contextmanager
    def trigger_sync_in_backward(model: nn.Module):
        """Reduce gradients in the next backward even inside ``no_sync`` / ``accumulate``."""

        set_gradient_sync(model, True)
        yield

    # -------------------------------------------------------- loss, backward
    def global_num_items(
        self, micro_batches: Iterable[Mapping[str, torch.Tensor]], label_key: str = "shift_labels"
    ) -> torch.Tensor:
        """Non-ignored label tokens of this optimizer step over all micro-batches and dp ranks
        (count *before* CP sharding), an int64 tensor on the device (no host sync). Divide each
        micro-batch's token-loss sum by this."""
        return self.engine.global_num_items(micro_batches, label_key)

    def loss_context(self):
        """The context the loss forward and backward must run in (``loss_parallel`` under TP)."""
        return self.engine.loss_context()

    def causal_lm_loss(
        self, logits: torch.Tensor, shift_labels: torch.Tensor, num_items_in_batch: int | torch.Tensor
    ):
        """Token-loss sum of this rank / the global token count (see ``global_num_items``)."""
        return self.engine.causal_lm_loss(logits, shift_labels, num_items_in_batch)

    def forward_loss(
        self, model: nn.Module, batch: Mapping[str, torch.Tensor], num_items_in_batch: int | torch.Tensor
    ) -> torch.Tensor:
        """Forward ``batch`` (``input_ids``, ``shift_labels``, ``position_ids``; CP-sharded already
        inside ``maybe_context_parallel``) and return this rank's token-loss sum / the global token
        count (``Engine.forward_loss``: the chunked loss where exact, else the logits)."""
        return self.engine.forward_loss(model, batch, num_items_in_batch)

    def pipeline_step(
        self, model: nn.Module, micro_batches: Sequence[Mapping[str, torch.Tensor]]
    ) -> torch.Tensor:
        """Under pipeline parallel (``pp_size`` > 1, ndparallel's own: Accelerate has none), the
        forward and backward of one optimizer step's micro-batches (``input_ids``,
        ``shift_labels``, ``position_ids``; this dp rank's, not CP-sharded) through the stages;
        returns the step's global mean token loss on every rank. Then ``clip_grad_norm_`` and
        ``optimizer.step()`` as usual: ``model(...)`` cannot run a model cut into stages."""
        pipeline = self.engine.pipeline_of(model)
        if pipeline is None:
            raise ValueError(
                "pipeline_step needs a model prepared with pp_size > 1; without pipeline parallel "
                "run forward_loss and backward per micro-batch"
            )

        micro_batches = [batch_to_device(mb, self.engine.device) for mb in micro_batches]
        n_items = self.engine.global_num_items(micro_batches)
        scale = self.scaler.scale if self.scaler is not None else None
        return self.engine.reduce_step_loss(pipeline.forward_backward(micro_batches, n_items, scale))

    def backward(
        self, loss: torch.Tensor, num_items_in_batch: int | torch.Tensor | None = None, **kwargs
    ) -> None:
        """Back-propagate ``loss``.

        With ``num_items_in_batch`` the loss is taken as already divided by the global token count
        (``causal_lm_loss``) and back-propagated as is: gradients are then layout-invariant.
        Without it (Accelerate's habit, e.g. ``model(**batch).loss``) the loss is a per-rank mean:
        it is divided by the accumulation steps (as Accelerate does) and the number of dp×cp ranks
        (gradients are summed over ranks here, averaged in Accelerate: the same result)."""
        if kwargs.pop("learning_rate", None) is not None:
            raise ValueError(
                "backward(learning_rate=...) is LOMO's fused update, not supported: use a torch optimizer"
            )
        if num_items_in_batch is None:
            dims = self.engine.dims
            loss = loss / (self.gradient_accumulation_steps * dims.dp * dims.cp)
        if self.scaler is not None:  # fp16: back-propagate the scaled loss (unscaled before the step)
            loss = loss * self.scaler.scale
        self.engine.backward(loss, **kwargs)

    def lomo_backward(self, loss: torch.Tensor, learning_rate: float) -> None:
        raise NotImplementedError(
            "LOMO optimizers are not supported by ndparallel: use a torch optimizer "
            "and accelerator.backward(loss)"
        )

    # ------------------------------------------------------------- gradients
    def clip_grad_norm_(self, parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2.0):
        """Clip to ``max_norm``; returns the true global norm (any layout, any mix of meshes). fp16:
        the gradients are unscaled first (as Accelerate does)."""
        self.unscale_gradients()
        return self.engine.clip_grad_norm_(parameters, max_norm, norm_type)

    def clip_grad_value_(self, parameters: Iterable[torch.Tensor], clip_value: float) -> None:
        """Clamp every gradient element to ``[-clip_value, clip_value]`` (elementwise: exact on
        shards)."""
        for p in parameters:
            if p.grad is not None:
                p.grad.clamp_(-clip_value, clip_value)

    def grad_norm(self, parameters: Iterable[torch.Tensor], norm_type: float = 2.0) -> torch.Tensor:
        """The global gradient norm without clipping (fp16: of the unscaled gradients)."""
        self.unscale_gradients()
        return self.engine.grad_norm(parameters, norm_type)

    def unscale_gradients(self, optimizer=None) -> None:
        """fp16: divide the gradients of ``optimizer`` (default: every prepared one) by the loss scale,
        once per step (``clip_grad_norm_`` calls it; the optimizer step does if nobody did)."""
        for o in [optimizer] if optimizer is not None else self._prepared_optimizers:
            if hasattr(o, "unscale_"):
                o.unscale_()

    @property
    def optimizer_step_was_skipped(self) -> bool:
        """Whether an fp16 overflow skipped the last step (every rank decides the same)."""
        return any(getattr(o, "step_was_skipped", False) for o in self._prepared_optimizers)

    # -------------------------------------------------------- mixed precision
    @contextlib.contextmanager
    def autocast(self, autocast_handler=None):
        """``torch.autocast`` to the mixed-precision dtype (a no-op for ``"no"``)."""
        handler = autocast_handler or self.autocast_handler
        dtype = self.param_dtype
        if dtype is None or (handler is not None and not handler.enabled):
            yield
            return
        kwargs = (
            {}
            if handler is None or handler.cache_enabled is None
            else {"cache_enabled": handler.cache_enabled}
        )
        with torch.autocast(device_type=self.device.type, dtype=dtype, **kwargs):
            yield

    @contextlib.contextmanager
    def profile(self, profile_handler=None):
        """``torch.profiler.profile`` from ``ProfileKwargs``; the trace is written to
        ``output_trace_dir/profile_{process_index}.json`` when that is set."""

        handler = profile_handler or self.profile_handler or ProfileKwargs()
        with handler.build() as prof:
            yield prof
        path = handler.trace_path(self.process_index)
        if path:
            prof.export_chrome_trace(path)

    @contextlib.contextmanager
    def join_uneven_inputs(self, joinables, even_batches: bool | None = None):
        """Accelerate joins DDP ranks with uneven batch counts; prepared loaders here always give
        every rank the same number of batches, so there is nothing to join."""
        if even_batches is False:
            raise ValueError("even_batches=False is not supported: prepared loaders are always even")
        yield
