"""Library log lines no user can act on, silenced in every ndparallel process (the command line
and every rank), each by its logger (the module) and its message, so nothing else those
loggers say is lost and nothing of ours is touched: torchao — imported by transformers whenever
it is installed, fp8 on or not — logs "Failed to load ... .so" for kernels built for other GPUs;
torch warns that torchao registers Enum classes as pytree constants; DTensor notes "sequential
all_gather" when export gathers FSDP × TP parameters."""

from __future__ import annotations

import logging
import re

NOISE = {
    "torchao": re.compile(r"Failed to load .*\.so"),
    "torch.utils._pytree": re.compile(r"is an Enum subclass and is now natively supported"),
    "torch.distributed.tensor._redistribute": re.compile(r"sequential all_gather operations"),
}
"""Logger name -> the message pattern dropped from it."""


class _DropNoise(logging.Filter):
    def __init__(self, pattern: re.Pattern) -> None:
        super().__init__()
        self.pattern = pattern

    def filter(self, record: logging.LogRecord) -> bool:
        return not self.pattern.search(record.getMessage())


def quiet_library_noise() -> None:
    """Attach the filters (once per logger: calling again adds nothing)."""
    for name, pattern in NOISE.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropNoise) for f in logger.filters):
            logger.addFilter(_DropNoise(pattern))
