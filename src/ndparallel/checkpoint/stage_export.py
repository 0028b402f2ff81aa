"""The consolidated HF export of a pipeline-parallel model: every stage gathers its own tensors
(its FSDP / TP collectives) and its first rank sends them, one at a time, to the first stage's
first rank, which writes them. Memory stays one tensor per rank, as without pipeline parallel."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
import torch.nn as nn


def is_pipeline_view(model: nn.Module) -> bool:
    """Is ``model`` a rank's pipeline stages (``parallel.pp.stages.StageView``)?"""
    return getattr(model, "pp_group", None) is not None


def pipeline_tied_copies(model: nn.Module) -> set[str]:
    """The last stage's copy of tied embeddings (``lm_head.weight``): the first stage's
    ``embed_tokens`` is the weight HF saves."""
    if not is_pipeline_view(model) or not getattr(model.config, "tie_word_embeddings", False):
        return set()
    return {"lm_head.weight"}


def _entries(state: dict, names: list[str], dtype) -> list[tuple[str, tuple, torch.dtype]]:
    out = []
    for n in names:
        v = state[n]
        out.append((n, tuple(v.shape), dtype if dtype is not None and v.is_floating_point() else v.dtype))
    return out


def stage_names(
    model: nn.Module, state: dict, names: list[str], dtype
) -> list[tuple[str, tuple, torch.dtype]]:
    """(name, shape, dtype) of every stage's tensors, in stage order, on every rank (one small
    object gather over the pp group)."""
    everyone = [None] * dist.get_world_size(model.pp_group)
    dist.all_gather_object(everyone, _entries(state, names, dtype), group=model.pp_group)
    return [e for part in everyone for e in part]


def stage_tensors(
    model: nn.Module, state: dict, names: list[str], gathered: Callable[[str], torch.Tensor], dtype
) -> Iterator[tuple[str, torch.Tensor | None]]:
    """(name, full tensor) of every stage's tensors on the first stage's first rank (None
    elsewhere), in stage order. Every rank must iterate it to the end (collectives)."""
    group = model.pp_group
    ranks = dist.get_process_group_ranks(group)
    me = ranks.index(dist.get_rank())
    everyone = [None] * len(ranks)
    dist.all_gather_object(everyone, _entries(state, names, dtype), group=group)
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    for p, entries in enumerate(everyone):
        for name, shape, dt in entries:
            full = gathered(name) if me == p else None  # stage p's own collectives
            if p == 0:
                yield name, full
            elif model.stage_main:  # the pipeline of the stages' first ranks carries it to rank 0
                if me == p:
                    dist.send(full.contiguous(), dst=ranks[0])
                elif me == 0:
                    buf = torch.empty(shape, dtype=dt, device=device)
                    dist.recv(buf, src=ranks[p])
                    yield name, buf
