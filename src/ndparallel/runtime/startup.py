"""The start of a process that will build a model: torch's and transformers' model code imported
with Python's cyclic garbage collector paused, then frozen out of every later collection.

Those imports create about 670,000 objects that live as long as the process; the collector,
triggered by allocation counts, walks the young ones again and again while they are being made:
~1.6 s of CPU, ~40 % of the import time, on a 2-core CPU machine (``bench/startup_gc.py``; a
one-rank tiny ``ndparallel train``: 4.1 s -> 3.3 s). Frozen, they are also never walked by a full
collection during training, nor copied page by page by a rank forked from this process. The calls
are the gc module's own (``gc.disable`` / ``gc.freeze``), as Python's documentation suggests.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import sys

MODEL_LIBRARIES = (
    "torch",
    "torch.distributed.tensor",
    "torch.distributed.fsdp",
    "torch.distributed.checkpoint",
    "transformers",
    "transformers.modeling_utils",
)
"""What every command that builds a model imports (the families' own modules stay lazy: small)."""


@contextlib.contextmanager
def paused_collector():
    """The cyclic collector off inside (``import_model_libraries``); back on after, as it was."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


_frozen = False
"""Whether this process (or the one it was forked from) has frozen objects: once true it stays
true (nothing here calls ``gc.unfreeze``). ``gc.get_freeze_count`` walks every frozen object —
~0.07 s for the ~800,000 a test process freezes, paid by every command run in it — so it is asked
at most once per process."""


def import_model_libraries() -> None:
    """Import what is missing of ``MODEL_LIBRARIES`` with the collector paused; the first time in
    a process (nothing frozen yet), then freeze every object alive. A later call freezes nothing,
    so the garbage a long process makes between two commands is still collected."""
    global _frozen
    missing = [name for name in MODEL_LIBRARIES if name not in sys.modules]
    _frozen = _frozen or gc.get_freeze_count() > 0
    if not missing and _frozen:
        return
    with paused_collector():
        for name in missing:
            importlib.import_module(name)
        if not _frozen:
            gc.freeze()
            _frozen = True
