"""One real rank of a large world: torch's fake process-group backend (the one torchtitan's
``comm.mode = fake_backend`` dry runs use). Collectives return at once without moving data;
everything else — this rank's shards, optimizer state, activations, kernels, checkpoint writes —
runs for real, so memory and compute time of rank ``rank`` of ``world_size`` can be measured on
one machine. Values that came through a collective are garbage: losses are meaningless.

The backend lives in ``torch.testing._internal.distributed.fake_pg`` (importing it registers the
``fake`` backend); tested with torch 2.11 and 2.13.
"""

from __future__ import annotations

import datetime

import torch.distributed as dist


def start_fake_world(world_size: int, rank: int = 0, timeout_s: float = 600.0) -> None:
    """Start the default process group as rank ``rank`` of a fake ``world_size``-rank world."""
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in a world of {world_size} ranks: use 0 <= rank < world size")
    if dist.is_initialized():
        raise RuntimeError("a process group already exists: a simulated rank needs a fresh process")
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group(
        "fake",
        store=FakeStore(),
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
