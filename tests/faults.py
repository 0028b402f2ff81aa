"""Faults the negative controls inject into the runtime, from the tests: each breaks one rule where
the runtime acts, through ``monkeypatch`` (undone after the test). The ranks ``run_on_ranks`` forks
afterwards inherit the fault; a one-process reference does not meet it (no gradient to reduce, no
expert on another rank, no pipeline stage holding a tied copy, one rank), so only the layout run is
broken.

A check that passes with one of these in place cannot tell that layout from a broken one."""

from __future__ import annotations

import torch

from ndparallel.engine.engine import Engine
from ndparallel.parallel.ep import expert
from ndparallel.parallel.fsdp import set_gradient_sync
from ndparallel.parallel.pp.schedule import Pipeline
from ndparallel.tools.agreement import RATIOS_ENV


def skip_grad_sync(monkeypatch) -> None:
    """Gradients are never reduced: every micro-batch's backward runs with FSDP's (and the replica
    all-reduce's) sync off, so each rank steps on its own gradients."""
    monkeypatch.setattr(Engine, "set_grad_sync", lambda self, model, enabled: set_gradient_sync(model, False))


def wrong_expert_rank(monkeypatch) -> None:
    """Every (token, expert) pair is sent one expert-parallel rank past its expert's, to the expert
    with the same local index there."""
    original = expert._dispatch_compute_combine

    def shifted(module, route, hidden, index, weights):
        return original(module, route, hidden, (index + route.local_experts) % route.num_experts, weights)

    monkeypatch.setattr(expert, "_dispatch_compute_combine", shifted)


def unsummed_tied_grads(monkeypatch) -> None:
    """Pipeline parallel leaves the two stage copies of tied embeddings with their own gradients."""
    monkeypatch.setattr(Pipeline, "_sum_tied_grads", lambda self: None)


def cross_documents(monkeypatch) -> None:
    """Under a layout (more than one rank) the model is given position_ids without restarts: its
    attention crosses the packed documents' starts."""
    original = Engine.batch_context

    def crossing(self, batch):
        if self.world_size > 1:
            positions = batch["position_ids"]
            batch["position_ids"] = torch.arange(positions.shape[-1], device=positions.device).expand_as(
                positions
            )
        return original(self, batch)

    monkeypatch.setattr(Engine, "batch_context", crossing)


def unrecorded(monkeypatch) -> None:
    """The verdicts of this test are not recorded as equal-to-one-process checks
    (``tools.agreement``'s ratio log): ``ndparallel verify`` does not know of the fault injected."""
    monkeypatch.delenv(RATIOS_ENV, raising=False)
