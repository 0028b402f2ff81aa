"""Axolotl's run controls, each a small object the trainer consults: the evaluation cadence
(``eval_steps`` / ``evals_per_epoch``), early stopping on the eval loss, the loss watchdog, and
which parameters train (``unfrozen_parameters``)."""

from __future__ import annotations

import re

import torch

from ndparallel.engine.nonfinite import NonFiniteError


def eval_every(eval_steps: int | None, evals_per_epoch: int | None, steps_per_epoch: int) -> int | None:
    """Steps between evaluations (None: no evaluation during training)."""
    if eval_steps:
        return eval_steps
    if evals_per_epoch:
        return max(1, steps_per_epoch // evals_per_epoch)
    return None


class EarlyStopping:
    """``early_stopping_patience``: True once ``patience`` evaluations in a row did not lower the
    best eval loss (every rank sees the same global eval loss, so all stop at the same step)."""

    def __init__(self, patience: int | None):
        self.patience, self.best, self.bad = patience, float("inf"), 0

    def should_stop(self, eval_loss: float) -> bool:
        if self.patience is None:
            return False
        if eval_loss < self.best:
            self.best, self.bad = eval_loss, 0
        else:
            self.bad += 1
        return self.bad >= self.patience


class LossWatchdog:
    """``loss_watchdog_threshold``: the logged training loss exceeded the threshold at ``patience``
    log steps in a row. ``action="stop"`` (Axolotl's: its callback sets ``should_training_stop``):
    ``check`` returns the warning line and the trainer ends the run normally (final model, exit 0);
    ``"fail"``: ``check`` raises ``NonFiniteError`` (exit 1, nothing more saved). It reads the loss the
    trainer already read at log steps: no extra host synchronisation."""

    def __init__(self, threshold: float | None, patience: int = 3, action: str = "stop"):
        if action not in ("stop", "fail"):
            raise ValueError(f"loss_watchdog_action must be 'stop' or 'fail', got {action!r}")
        self.threshold, self.patience, self.action, self.high = threshold, patience, action, 0

    def check(self, step: int, loss: float) -> str | None:
        """None while training goes on; the warning line when the run should stop (``stop``)."""
        if self.threshold is None:
            return None
        self.high = self.high + 1 if loss > self.threshold else 0
        if self.high < self.patience:
            return None
        what = (
            f"step {step}: the loss {loss:.4g} stayed above loss_watchdog_threshold={self.threshold:g} at "
            f"{self.high} log steps in a row"
        )
        if self.action == "fail":
            raise NonFiniteError(
                f"{what}; training stopped (lower learning_rate, check the data, or raise the "
                "threshold); checkpoints written before are intact"
            )
        return (
            f"{what}: stopping training as Axolotl does (the final model is saved; "
            "loss_watchdog_action: fail exits 1 instead)"
        )


def freeze_except(model: torch.nn.Module, patterns: list[str] | None) -> int:
    """``unfrozen_parameters``: only parameters whose name matches one of ``patterns`` (``re.match``)
    keep ``requires_grad``; returns how many trainable tensors remain. Called before the first
    forward (FSDP2 reads ``requires_grad`` when it first all-gathers)."""
    if not patterns:
        return sum(p.requires_grad for p in model.parameters())
    compiled = [re.compile(p) for p in patterns]
    kept = 0
    for name, param in model.named_parameters():
        clean = name.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", "")
        param.requires_grad_(any(c.match(clean) for c in compiled) and param.requires_grad)
        kept += param.requires_grad
    return kept


def unmatched_patterns(names: list[str], patterns: list[str] | None) -> list[str]:
    """Patterns of ``unfrozen_parameters`` that match no parameter name (checked before launch)."""
    return [p for p in patterns or [] if not any(re.match(p, n) for n in names)]
