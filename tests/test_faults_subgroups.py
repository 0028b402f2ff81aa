"""The collective timeout reaches every group of the mesh, not only the default one: a rank that never
joins a collective on the tp, cp or dp_shard sub-group fails its peer within the timeout."""

import time

import torch
import torch.distributed as dist

from ndparallel.testing import run_on_ranks

TIMEOUT_S = 4.0
DIMS = ("tp", "cp", "dp_shard", "dp_replicate", "dp", "dp_shard_cp", "dp_cp")
STALLED = ("tp", "cp", "dp_shard")


def _group_timeouts_and_stalls():
    from ndparallel import Accelerator, ParallelismConfig

    acc = Accelerator(ParallelismConfig(dp_shard_size=2, cp_size=2, tp_size=2), timeout_s=TIMEOUT_S)
    timeouts = {
        d: acc.mesh(d).get_group()._get_backend(torch.device("cpu")).options._timeout.total_seconds()
        for d in DIMS
    }
    stalls = {}
    if dist.get_rank() == 0:  # its peer in each group never joins
        # the three stalls at once (each group has its own gloo threads and timeout): one wait of
        # TIMEOUT_S instead of three in a row, each still timed from its own start
        groups = {d: acc.mesh(d).get_group() for d in STALLED}
        t0 = time.monotonic()
        works = {d: dist.all_reduce(torch.ones(1), group=g, async_op=True) for d, g in groups.items()}
        for dim, work in works.items():
            try:
                work.wait()
                stalls[dim] = None
            except RuntimeError:
                stalls[dim] = time.monotonic() - t0
    return timeouts, stalls


def test_every_mesh_group_times_out():
    results = run_on_ranks(_group_timeouts_and_stalls, 8, timeout_s=120)
    for timeouts, _ in results:
        assert timeouts == {d: TIMEOUT_S for d in DIMS}
    stalls = results[0][1]
    assert set(stalls) == set(STALLED), stalls
    for dim, waited in stalls.items():
        assert waited is not None, f"{dim}: the collective returned although a peer never joined"
        assert TIMEOUT_S - 0.5 <= waited <= TIMEOUT_S + 10, (dim, waited)
