"""Run by a real launcher (``accelerate launch --config_file``, ``ndparallel launch``, torchrun): our
copy of Accelerate's ``nd_parallel_trainer.py`` with the command line's arguments, its layout from the
``PARALLELISM_CONFIG_*`` variables the launcher set; rank 0 prints its log history as one
``HISTORY {json}`` line (the Trainer's own printed logs are rounded)."""

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # nd_utils, beside it

import nd_parallel_trainer  # noqa: E402

history = nd_parallel_trainer.main(sys.argv[1:])
if os.environ.get("RANK", "0") == "0":
    print("HISTORY", json.dumps(history), flush=True)
