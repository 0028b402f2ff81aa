"""The Trainer door: transformers' ``Trainer`` on ndparallel's engine by changing the imports.

    from ndparallel.transformers import Trainer, TrainingArguments   # was: from transformers import ...
    from ndparallel import ParallelismConfig                           # was: from accelerate ...

``parallel_trainer(SomeTrainer)`` does the same for any ``Trainer`` subclass (docs/trainer.md)."""

from ndparallel.runtime.extras import require
from ndparallel.runtime.quiet import quiet_library_noise

require("trainer", "the Trainer door (ndparallel.transformers)")  # transformers' Trainer needs accelerate
quiet_library_noise()  # transformers' Trainer imports torchao, whose lines no user can act on

from ndparallel.transformers.trainer_door import Trainer, TrainerDoor, parallel_trainer  # noqa: E402
from ndparallel.transformers.training_arguments import (  # noqa: E402
    ParallelArguments,
    TrainingArguments,
    parallel_arguments,
)

__all__ = [
    "ParallelArguments",
    "Trainer",
    "TrainerDoor",
    "TrainingArguments",
    "parallel_arguments",
    "parallel_trainer",
]
