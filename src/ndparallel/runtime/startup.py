"""The start of a process that will build a model: torch's and transformers' model code imported
with Python's cyclic garbage collector paused, then frozen out of every later collection.

Those imports create about a million objects that live as long as the process; the collector,
triggered by allocation counts, walks the young ones again and again while they are being made:
~0.9 s, ~20 % of the import time, on a 2-core CPU machine (a one-rank tiny ``ndparallel train``:
4.1 s -> 3.3 s, measured in docs/testing.md). Frozen, they are also never walked by a full
collection during training. The gc module has no other switch for this; the calls are its own
``gc.disable`` / ``gc.freeze``, as Python's documentation suggests before a fork.
"""

from __future__ import annotations

import gc
import importlib
import sys

MODEL_LIBRARIES = ("torch", "torch.distributed.tensor", "torch.distributed.fsdp", "torch.distributed.checkpoint",
                   "transformers", "transformers.modeling_utils")
"""What every command that builds a model imports (the families' own modules stay lazy: small)."""


def import_model_libraries() -> None:
    """Import ``MODEL_LIBRARIES`` with the collector paused, then freeze what exists. Nothing when
    they are imported already (a second command in one process: its objects are not frozen, so
    garbage made since start-up is still collected)."""
    if all(name in sys.modules for name in MODEL_LIBRARIES):
        return
    enabled = gc.isenabled()
    gc.disable()
    try:
        for name in MODEL_LIBRARIES:
            importlib.import_module(name)
    finally:
        if enabled:
            gc.freeze()
            gc.enable()
