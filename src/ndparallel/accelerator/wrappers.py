"""What ``prepare`` returns around optimizers, schedulers and data loaders, with Accelerate's
semantics: during gradient accumulation the optimizer's ``step``/``zero_grad`` and the scheduler's
``step`` do nothing until the micro-batch that completes a step (``sync_gradients``); the loader
marks its last batch so that batch completes a step, and can synchronise RNG states."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ndparallel.accelerator.accelerator_state import GradientState
from ndparallel.techniques.grad_norm import total_grad_norm


class AcceleratedOptimizer(torch.optim.Optimizer):
    """Delegates to ``optimizer``; ``step``/``zero_grad`` only run when gradients are synced. With an
    fp16 ``scaler`` (``engine.LossScaler``) ``step`` unscales the gradients (unless
    ``accelerator.clip_grad_norm_`` / ``unscale_gradients`` did), and skips the step when their
    global norm is not finite (the same decision on every rank), backing off the scale."""

    def __init__(self, optimizer: torch.optim.Optimizer, gradient_state: GradientState, scaler=None):
        # No super().__init__: the wrapped optimizer owns param_groups, state and defaults.
        self.optimizer = optimizer
        self.gradient_state = gradient_state
        self.scaler = scaler
        self._is_overflow = False
        self._unscaled = False
        self._steps = 0

    state = property(lambda self: self.optimizer.state, lambda self, v: setattr(self.optimizer, "state", v))
    param_groups = property(
        lambda self: self.optimizer.param_groups, lambda self, v: setattr(self.optimizer, "param_groups", v)
    )
    defaults = property(
        lambda self: self.optimizer.defaults, lambda self, v: setattr(self.optimizer, "defaults", v)
    )

    def add_param_group(self, param_group: dict) -> None:
        self.optimizer.add_param_group(param_group)

    def load_state_dict(self, state_dict: dict) -> None:
        self.optimizer.load_state_dict(state_dict)

    def state_dict(self) -> dict:
        return self.optimizer.state_dict()

    def zero_grad(self, set_to_none: bool | None = None) -> None:
        if self.gradient_state.sync_gradients:
            self.optimizer.zero_grad(**({} if set_to_none is None else {"set_to_none": set_to_none}))

    def _params(self) -> list[torch.Tensor]:
        return [p for group in self.param_groups for p in group["params"]]

    def unscale_(self) -> None:
        """Divide the gradients by the loss scale (once per step; fp16 only)."""
        if self.scaler is not None and not self._unscaled:
            self.scaler.unscale_(self._params())
            self._unscaled = True

    def step(self, closure=None):
        if not self.gradient_state.sync_gradients:
            return None
        self._steps += 1
        if self.scaler is not None:
            self.unscale_()
            self._unscaled = False
            self._is_overflow = not self.scaler.update(total_grad_norm(self._params()), self._steps)
            if self._is_overflow:
                return None
        return self.optimizer.step(closure) if closure is not None else self.optimizer.step()

    def train(self):
        return self.optimizer.train() if hasattr(self.optimizer, "train") else None

    def eval(self):
        return self.optimizer.eval() if hasattr(self.optimizer, "eval") else None

    @property
    def step_was_skipped(self) -> bool:
        """True when the last step was skipped for an fp16 overflow (the scale was halved)."""
        return self._is_overflow

    def __repr__(self) -> str:
        return f"AcceleratedOptimizer({self.optimizer!r})"


class AcceleratedScheduler:
    """Steps the LR scheduler only when the optimizer stepped. Without ``split_batches`` each step
    advances it ``dp_size`` times, because the global batch is ``dp_size`` loader batches
    (Accelerate advances it by the world size, which over-counts tp/cp ranks sharing a batch)."""

    def __init__(
        self,
        scheduler,
        optimizers,
        gradient_state: GradientState,
        steps_per_update: int,
        step_with_optimizer: bool = True,
        split_batches: bool = False,
    ):
        self.scheduler = scheduler
        self.optimizers = list(optimizers)
        self.gradient_state = gradient_state
        self.steps_per_update = steps_per_update
        self.step_with_optimizer = step_with_optimizer
        self.split_batches = split_batches

    def step(self, *args, **kwargs) -> None:
        if not self.step_with_optimizer:
            self.scheduler.step(*args, **kwargs)
            return
        if not self.gradient_state.sync_gradients:
            if self.gradient_state.adjust_scheduler:
                self.scheduler._step_count += 1
            return
        if any(getattr(o, "step_was_skipped", False) for o in self.optimizers):
            return
        for _ in range(1 if self.split_batches else self.steps_per_update):
            total = getattr(self.scheduler, "total_steps", None)
            if total is None or self.scheduler._step_count <= total:
                self.scheduler.step(*args, **kwargs)

    def get_last_lr(self):
        return self.scheduler.get_last_lr()

    def state_dict(self):
        return self.scheduler.state_dict()

    def load_state_dict(self, state_dict) -> None:
        self.scheduler.load_state_dict(state_dict)

    def get_lr(self):
        return self.scheduler.get_lr()

    def print_lr(self, *args, **kwargs):
        return self.scheduler.print_lr(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["scheduler"], name)


def synchronize_rng_states(rng_types, generator: torch.Generator | None = None) -> None:
    """Give every rank rank 0's RNG state for each of ``rng_types`` (torch / cuda / generator)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    for kind in rng_types:
        if kind == "torch":
            torch.set_rng_state(_broadcast_state(torch.get_rng_state()))
        elif kind == "cuda" and torch.cuda.is_available():
            torch.cuda.set_rng_state(_broadcast_state(torch.cuda.get_rng_state()))
        elif kind == "generator" and generator is not None:
            generator.set_state(_broadcast_state(generator.get_state()))


def _broadcast_state(state: torch.Tensor) -> torch.Tensor:
    state = state.clone()
    dist.broadcast(state, src=0)  # a CPU uint8 tensor: gloo (beside NCCL on GPU runs)
    return state


class PreparedDataLoader:
    """Iterates ``loader`` (already sharded over the dp ranks), moving batches to the device, and
    tells ``gradient_state`` when the last batch is out (it then completes a step). Every other
    attribute is the loader's."""

    def __init__(
        self,
        loader,
        gradient_state: GradientState,
        rng_types=(),
        skip_batches: int = 0,
        total_samples: int | None = None,
        global_batch: int | None = None,
    ):
        self.loader = loader
        self.gradient_state = gradient_state
        self.rng_types = list(rng_types)
        self.skip_batches = skip_batches
        self.total_samples = total_samples
        self.global_batch = global_batch
        self.iteration = 0

    def __len__(self) -> int:
        return len(self.loader) - self.skip_batches

    def set_epoch(self, epoch: int) -> None:
        """The sampler's epoch: a shuffling sampler draws a new (seeded) order each epoch."""
        self.iteration = epoch
        sampler = getattr(getattr(self.loader, "loader", self.loader), "sampler", None)
        if hasattr(sampler, "set_epoch"):
            sampler.set_epoch(epoch)

    def _remainder(self) -> int:
        if self.total_samples is None or not self.global_batch:
            return -1
        return self.total_samples % self.global_batch

    def __iter__(self):
        self.set_epoch(self.iteration)  # as Accelerate: each pass over the data is a new epoch
        synchronize_rng_states(
            self.rng_types, getattr(getattr(self.loader, "loader", self.loader), "generator", None)
        )
        state = self.gradient_state
        state.end_of_dataloader, state.in_dataloader, state.remainder = False, True, self._remainder()
        it = iter(self.loader)
        try:
            for _ in range(self.skip_batches):
                next(it)
            current = next(it)
        except StopIteration:
            state.end_of_dataloader, state.in_dataloader = True, False
            return
        try:
            for nxt in it:
                yield current
                current = nxt
            state.end_of_dataloader = True
            yield current
        finally:
            state.in_dataloader = False
            self.iteration += 1

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["loader"], name)
