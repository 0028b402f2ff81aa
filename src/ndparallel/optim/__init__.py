"""Optimizers and learning-rate schedules: AdamW / SGD (``build``), low-bit AdamW states from torchao
(``lowbit``), Muon (``muon``), the names a config accepts (``names``, torch-free). Engine material:
they know tensors and parameter groups, nothing of the trainer or of a config file.

``build_optimizer`` and ``build_scheduler`` are imported on first use (PEP 562): reading a config's
optimizer name imports no torch."""

__all__ = ["build_optimizer", "build_scheduler"]


def __getattr__(name: str):
    if name in __all__:
        from ndparallel.optim import build

        return getattr(build, name)
    raise AttributeError(f"module 'ndparallel.optim' has no attribute {name!r}")
