"""What a run does when the loss or the gradient norm stops being finite (a diverging run).

``stop`` (default): every step records, on the device, the first step whose loss or gradient norm
was not finite; the trainer checks it (one host read) at each log step, before each checkpoint and
at the end, and stops with ``NonFiniteError`` naming that step — so no checkpoint or final model
holding NaN is ever written, and no per-step host synchronisation is added.
``skip``: the optimizer step is skipped when the step is not finite (one host read per step, as a
gradient scaler does); more than ``max_consecutive_skips`` in a row stop the run as above.
"""

from __future__ import annotations

import warnings

import torch


class NonFiniteError(RuntimeError):
    """Training produced a non-finite loss or gradient norm; the message names the step."""


class NonFiniteGuard:
    """Watches ``(loss, grad_norm)`` of every step; see the module docstring."""

    def __init__(self, mode: str = "stop", max_consecutive_skips: int = 10):
        if mode not in ("stop", "skip"):
            raise ValueError(f"on_nonfinite={mode!r}: use 'stop' or 'skip'")
        self.mode = mode
        self.max_consecutive_skips = max_consecutive_skips
        self.skipped = 0
        self.consecutive = 0
        self._first_bad: torch.Tensor | None = None

    def step_is_finite(self, step: int, loss: torch.Tensor, grad_norm: torch.Tensor) -> bool:
        """Record step ``step`` (1-based); False means: do not apply this optimizer step."""
        bad = ~(torch.isfinite(loss.detach()) & torch.isfinite(grad_norm.detach().to(loss.device)))
        if self.mode == "skip":
            if not bool(bad):
                self.consecutive = 0
                return True
            self.skipped += 1
            self.consecutive += 1
            warnings.warn(
                f"step {step}: non-finite loss or gradient norm; the optimizer step is skipped "
                f"({self.consecutive} in a row)",
                stacklevel=2,
            )
            if self.consecutive > self.max_consecutive_skips:
                raise NonFiniteError(self._message(step, f"{self.consecutive} steps in a row"))
            return False
        if self._first_bad is None:
            self._first_bad = torch.full((), -1, dtype=torch.int64, device=loss.device)
        self._first_bad = torch.where(bad & (self._first_bad < 0), step, self._first_bad)
        return True

    def check(self) -> None:
        """Raise ``NonFiniteError`` if a recorded step was not finite (one host read)."""
        if self._first_bad is not None and int(self._first_bad) >= 0:
            raise NonFiniteError(self._message(int(self._first_bad), "from then on the model is not trained"))

    def _message(self, step: int, what: str) -> str:
        skip = ", or set on_nonfinite: skip" if self.mode == "stop" else ""  # skip mode: it already did
        return (
            f"step {step}: the loss or the gradient norm is not finite (NaN/inf; {what}). "
            f"Training stopped: lower learning_rate, set max_grad_norm, check the data{skip}; "
            "checkpoints written before that step are intact"
        )
