"""Checkpoints of pipeline-parallel models: each stage saves its own tensors under the unsplit
model's names (DCP), rank 0's ``state.json`` lists every stage's (``merge_stage_skeletons``), and
a stage loads only its own names (``restrict_to_stage``) — so a checkpoint resumes on any number
of stages, PP 1 included, and the reverse."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch.distributed as dist
import torch.nn as nn

from ndparallel.checkpoint.stage_export import is_pipeline_view, pipeline_tied_copies

TIED_SOURCE = {"lm_head.weight": "model.embed_tokens.weight"}
"""The last stage's copy of tied embeddings -> the weight it copies (the pipeline families' names):
the copy's optimizer state is not saved (the unsplit model has one parameter) and is loaded from
the weight's."""


def _pipeline_group(models: Sequence[nn.Module]):
    return next((m.pp_group for m in models if is_pipeline_view(m)), None)


def merge_stage_skeletons(models: Sequence[nn.Module], state: dict) -> None:
    """Make ``state["models"]`` / ``state["optimizers"]`` (this stage's skeletons) every stage's,
    in place. Collective over the pp group; nothing happens without pipeline parallel."""
    group = _pipeline_group(models)
    if group is None:
        return
    copies = set().union(*(pipeline_tied_copies(m) for m in models))
    parts: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(parts, (state["models"], state["optimizers"]), group=group)
    state["models"] = [_union([p[0][i] for p in parts]) for i in range(len(state["models"]))]
    state["optimizers"] = [
        _merge_optimizer([p[1][i] for p in parts], copies) for i in range(len(state["optimizers"]))
    ]


def _union(dicts: list[dict]) -> dict:
    out: dict = {}
    for d in dicts:
        out.update(d)
    return out


def _merge_optimizer(skeletons: list[dict], copies: set[str]) -> dict:
    """Optimizer skeletons of the stages as one: every parameter's state, each param group's
    parameters in stage order (the groups' hyper-parameters are the same on every stage), the
    tied weight's last-stage ``copies`` left out."""
    first = skeletons[0]
    if not isinstance(first, dict) or "param_groups" not in first:
        return first
    groups = []
    for g, group in enumerate(first["param_groups"]):
        params = [p for s in skeletons for p in s["param_groups"][g]["params"] if p not in copies]
        groups.append({**group, "params": list(dict.fromkeys(params))})
    state = {k: v for k, v in _union([s.get("state", {}) for s in skeletons]).items() if k not in copies}
    return {**first, "state": state, "param_groups": groups}


def restrict_to_stage(saved: dict, current: dict, optimizer: bool) -> dict:
    """The part of a saved skeleton this rank's stages load: the names ``current`` (this rank's
    own skeleton) has; an optimizer's param groups keep their saved hyper-parameters."""
    if not optimizer:
        return {k: v for k, v in saved.items() if k in current}
    mine, kept = current.get("state", {}), saved.get("state", {})
    state = {
        k: kept[k] if k in kept else kept[TIED_SOURCE[k]]
        for k in mine
        if k in kept or TIED_SOURCE.get(k) in kept
    }
    groups = [{**s, "params": c["params"]} for s, c in zip(saved["param_groups"], current["param_groups"])]
    return {**saved, "state": state, "param_groups": groups}
