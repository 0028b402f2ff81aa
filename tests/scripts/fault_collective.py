"""A 3-rank job in which one rank misbehaves while the others sit in a collective.

python -m ndparallel launch --nproc-per-node 3 fault_collective.py raise|hang MARKER_DIR
"""

import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from ndparallel.runtime.distributed import init_distributed

mode, marker_dir = sys.argv[1], Path(sys.argv[2])
torch.set_num_threads(1)
info = init_distributed("cpu")
t = torch.ones(4)
dist.all_reduce(t)  # everybody is up
if info.rank == 1:
    (marker_dir / "misbehaving").write_text(str(time.time()))
    if mode == "raise":
        raise RuntimeError("rank 1 fails on purpose")
    time.sleep(3600)  # hang: never joins the next collective
dist.all_reduce(t)  # the others wait here for rank 1
(marker_dir / f"finished-{info.rank}").write_text("should not happen")
