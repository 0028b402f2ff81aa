"""Optimizers and learning-rate schedules: AdamW / SGD (``build``), low-bit AdamW states from torchao
(``lowbit``), Muon (``muon``). Engine material: they know tensors and parameter groups, nothing of
the trainer or of a config file."""

from ndparallel.optim.build import build_optimizer, build_scheduler

__all__ = ["build_optimizer", "build_scheduler"]
