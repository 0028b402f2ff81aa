"""Library log lines no user can act on, silenced in every ndparallel process (the command line
and every rank), each by its logger (the module) and its message, so nothing else those
loggers say is lost and nothing of ours is touched: torchao — imported by transformers whenever
it is installed, fp8 on or not — logs "Failed to load ... .so" for kernels built for other GPUs;
torch warns that torchao registers Enum classes as pytree constants; DTensor notes "sequential
all_gather" when export gathers FSDP × TP parameters. Two Python warnings likewise, by message
(and module where it is known): FSDP2's "returned a view tensor" for a wrapped module whose output
is a view (transformers' decoder applies no in-place op to those outputs; the equivalence tests
prove the gradients) and peft's call of a deprecated transformers name."""

from __future__ import annotations

import logging
import re
import warnings

NOISE = {
    "torchao": re.compile(r"Failed to load .*\.so"),
    "torch.utils._pytree": re.compile(r"is an Enum subclass and is now natively supported"),
    "torch.distributed.tensor._redistribute": re.compile(r"sequential all_gather operations"),
}
"""Logger name -> the message pattern dropped from it."""

WARNINGS = [
    (r".*returned a view tensor", r"torch\.distributed\.fsdp"),
    (r".*is_gradient_checkpointing", ""),
]
"""(message pattern, module pattern) of the Python warnings ignored."""


class _DropNoise(logging.Filter):
    def __init__(self, pattern: re.Pattern) -> None:
        super().__init__()
        self.pattern = pattern

    def filter(self, record: logging.LogRecord) -> bool:
        return not self.pattern.search(record.getMessage())


def quiet_library_noise() -> None:
    """Attach the filters (once per logger: calling again adds nothing) and ignore ``WARNINGS``
    (a filter added again replaces its copy)."""
    for message, module in WARNINGS:
        warnings.filterwarnings("ignore", message=message, module=module)
    for name, pattern in NOISE.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropNoise) for f in logger.filters):
            logger.addFilter(_DropNoise(pattern))
