"""Helpers the pipeline equivalence tests share: the ranks a layout needs, and a run that also
counts this rank's FSDP gradient reductions."""

from __future__ import annotations

from ndparallel.tools.equivalence import train_under_layout


def world_of(layout: dict) -> int:
    """Ranks of a harness layout (``{"pp_size": 2, "dp_shard_size": 2, ...}``): the product of its
    degrees, but expert parallel borrows its ranks from the others."""
    n = 1
    for dim, size in layout.items():
        n *= 1 if dim == "ep_size" else size
    return n


def train_counting_reductions(setup, layout):
    """``train_under_layout``'s result and this rank's FSDP gradient reductions (one
    ``foreach_reduce`` per FSDP unit and reduction; rank 0: the first stage)."""
    import torch.distributed.fsdp._fully_shard._fsdp_param_group as fsdp_group

    calls, reduce = [0], fsdp_group.foreach_reduce

    def counting(*args, **kwargs):
        calls[0] += 1
        return reduce(*args, **kwargs)

    fsdp_group.foreach_reduce = counting  # torch-internal: a count, in a forked rank only
    return train_under_layout(setup, layout), calls[0]
