"""Library log lines no user can act on, silenced in every ndparallel process (the command line
and every rank): torchao — imported by transformers whenever it is installed, fp8 on or not —
logs "Failed to load ... .so" for kernels built for other GPUs, and torch warns that torchao
registers Enum classes as pytree constants; DTensor notes "sequential all_gather" when export
gathers FSDP × TP parameters. Only these loggers' levels are raised (to ERROR)."""

from __future__ import annotations

import logging

QUIET_LOGGERS = ("torchao", "torch.utils._pytree", "torch.distributed.tensor._redistribute")


def quiet_library_noise() -> None:
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
