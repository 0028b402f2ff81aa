"""Dynamic loss scaling for fp16 mixed precision, with one decision for the whole mesh.

fp16 has 5 exponent bits: gradients below ~6e-8 flush to zero, above 65504 overflow. The loss is
multiplied by ``scale`` before backward (so small gradients survive the fp16 backward), the fp32
gradients are multiplied by ``1/scale`` before clipping and the optimizer, and:

* an overflow (a non-finite *global* gradient norm) skips the optimizer step and halves the scale;
* ``growth_interval`` finite steps in a row double it;
* a scale falling below ``min_scale`` stops the run (``NonFiniteError``): the gradients are not
  finite at any usable scale, the run has diverged.

Why not ``torch.amp.GradScaler``: its ``found_inf`` is per device, i.e. per rank — with sharded
gradients one rank may overflow while its peers do not, and their scales and parameters drift
apart. ``ShardedGradScaler`` all-reduces ``found_inf`` over the world and does run on FSDP2's
DTensor gradients, but only through DTensor's implicit replication of its plain ``found_inf``
tensor (a warning each step) and with one more all-reduce per step. The global gradient norm the
step computes anyway (``techniques/grad_norm.py``: one value, the same on every rank, whatever the
layout) is non-finite exactly when some rank's gradient shard is: it decides here, with no extra
collective. Scales are powers of two, so scaling and unscaling are exact in fp32 (the gradients of
a scaled step equal the unscaled ones wherever fp16 did not underflow).

Cost: one host read per step (whether to step the optimizer), as every gradient scaler has.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from ndparallel.engine.nonfinite import NonFiniteError
from ndparallel.techniques.grad_norm import grouped_grads


class LossScaler:
    """The loss scale of an fp16 run and its growth/backoff rule (see the module docstring).
    State (``state_dict``) is five numbers, saved in checkpoints so a resumed run keeps its scale."""

    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        min_scale: float = 1.0,
    ) -> None:
        if not (init_scale > 0 and math.isfinite(init_scale)):
            raise ValueError(f"loss scale {init_scale}: use a finite number > 0 (a power of two, e.g. 65536)")
        if growth_factor <= 1 or not 0 < backoff_factor < 1 or growth_interval < 1:
            raise ValueError(
                "loss scaling needs growth_factor > 1, 0 < backoff_factor < 1, growth_interval >= 1"
            )
        self.scale = float(init_scale)
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.growth_interval = growth_interval
        self.min_scale = min_scale
        self.good_steps = 0
        """Finite steps since the last change of the scale."""
        self.skipped = 0
        """Optimizer steps skipped for an overflow (the run's: kept in checkpoints)."""

    def unscale_(self, parameters: Iterable[torch.Tensor]) -> None:
        """Multiply every gradient by ``1/scale`` in place (DTensor gradients: their local shards)."""

        inv = 1.0 / self.scale
        for grads in grouped_grads(parameters).values():
            torch._foreach_mul_(grads, inv)

    def update(self, grad_norm: torch.Tensor, step: int) -> bool:
        """After unscaling: whether the step may be applied (one host read of the global norm);
        on an overflow back off (raising ``NonFiniteError`` below ``min_scale``), else maybe grow."""
        if bool(torch.isfinite(grad_norm)):
            self.good_steps += 1
            if self.good_steps >= self.growth_interval:
                self.scale *= self.growth_factor
                self.good_steps = 0
            return True
        self.skipped += 1
        self.good_steps = 0
        self.scale *= self.backoff_factor
        if self.scale < self.min_scale:
            raise NonFiniteError(
                f"step {step}: the fp16 gradients overflow even at loss scale "
                f"{self.scale / self.backoff_factor:g} "
                f"(the floor is loss_scale_min: {self.min_scale:g}): the run has diverged or does not fit "
                f"fp16's "
                "range. Training stopped: use bf16: true (or fp32), lower learning_rate or set "
                "max_grad_norm; "
                "checkpoints written before that step are intact"
            )
        return False

    def state_dict(self) -> dict:
        return {
            "scale": self.scale,
            "good_steps": self.good_steps,
            "skipped": self.skipped,
            "growth_factor": self.growth_factor,
            "backoff_factor": self.backoff_factor,
            "growth_interval": self.growth_interval,
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue with a saved scale and its count of good steps (the factors given now win)."""
        self.scale = float(state["scale"])
        self.good_steps = int(state["good_steps"])
        self.skipped = int(state.get("skipped", 0))  # checkpoints written before it was kept: 0
