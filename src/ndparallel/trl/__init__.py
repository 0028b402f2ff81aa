"""TRL's trainers on ndparallel's engine by changing the imports (``pip install ndparallel[trl]``):

    from ndparallel.trl import SFTConfig, SFTTrainer   # was: from trl import SFTConfig, SFTTrainer
    from ndparallel.trl import DPOConfig, DPOTrainer   # was: from trl import DPOConfig, DPOTrainer

Each is TRL's own class with the Trainer door under it (``parallel_trainer``) or, for a config,
ndparallel's process-group start and refusals mixed in (``parallel_arguments``); the same two calls
put any other TRL trainer on ndparallel (docs/trainer.md)."""

from ndparallel.runtime.extras import require
from ndparallel.runtime.quiet import quiet_library_noise

require("trl", "ndparallel.trl (TRL's trainers)")  # an optional extra: this door's own package
quiet_library_noise()  # transformers' Trainer imports torchao, whose lines no user can act on

import trl  # noqa: E402

from ndparallel.transformers import parallel_arguments, parallel_trainer  # noqa: E402

SFTTrainer = parallel_trainer(trl.SFTTrainer)
SFTConfig = parallel_arguments(trl.SFTConfig)
DPOTrainer = parallel_trainer(trl.DPOTrainer, splits_sequences=False)  # log-probability sums per sequence
DPOConfig = parallel_arguments(trl.DPOConfig)

__all__ = ["DPOConfig", "DPOTrainer", "SFTConfig", "SFTTrainer"]
