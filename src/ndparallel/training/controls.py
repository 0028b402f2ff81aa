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
    """``loss_watchdog_threshold``: stop (like a diverged run: exit 1, nothing more saved) when the
    logged training loss exceeds the threshold at ``patience`` log steps in a row. It reads the loss
    the trainer already read at log steps: no extra host synchronisation."""

    def __init__(self, threshold: float | None, patience: int = 3):
        self.threshold, self.patience, self.high = threshold, patience, 0

    def check(self, step: int, loss: float) -> None:
        if self.threshold is None:
            return
        self.high = self.high + 1 if loss > self.threshold else 0
        if self.high >= self.patience:
            raise NonFiniteError(f"step {step}: the loss {loss:.4g} stayed above loss_watchdog_threshold="
                                 f"{self.threshold:g} at {self.high} log steps in a row; training stopped (lower "
                                 "learning_rate, check the data, or raise the threshold); checkpoints written "
                                 "before are intact")


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
