"""Pipeline parallel: one optimizer step's micro-batches through torch's pipeline schedules.

torch (``torch.distributed.pipelining``) provides the stages' point-to-point transfers and the
schedules (GPipe, 1F1B, interleaved 1F1B, zero-bubble); what it does not do is written here:

* ``StageModule`` — the forward one stage runs: transformers' own forward of the cut model
  (``stages.cut_stage``) on token ids (first stage) or hidden states (the others), and on
  the last stage the engine's layout-invariant loss (token-loss sum / the step's global token
  count, chunked where exact), so the pipeline trains what one device trains.
* ``Pipeline.forward_backward`` — the step's micro-batches joined into one batch (rows padded to
  one width: a right pad never changes an earlier token), CP-sharded like any batch, split by the
  schedule into ``microbatches`` pieces; every stage gets ``position_ids`` (rotary, packed
  documents) and ``shift_labels`` as keyword inputs. Torch's stages keep the shapes of their first
  step: a step of another width (``pad_to_sequence_len: false``) runs on stages of its own.
* tied input / output embeddings: the first stage's embedding and the last stage's LM head are two
  copies; their gradients are summed after the step (so both take the same update) and the norm
  counts the weight once.
* the gradient norm across stages (``Engine.grad_norm``: one all-reduce over every stage, the
  tied copy not counted twice) and the step loss, which only the last stage has, sent to every rank.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Protocol

import torch
import torch.distributed as dist
import torch.nn as nn

from ndparallel.layout.dims import ParallelDims
from ndparallel.models.adapters import base_model_of
from ndparallel.parallel.fsdp import fsdp_root
from ndparallel.parallel.options import StrategyOptions
from ndparallel.parallel.pp.split import StagePlan
from ndparallel.techniques.loss import IGNORE_INDEX


class StageRuntime(Protocol):
    """What the pipeline uses of the process's runtime (``engine.Engine`` is one): the layout and
    options, the groups, the last stage's loss and the contexts a step's batch and loss run in."""

    options: StrategyOptions
    dims: ParallelDims
    mesh: object
    """The ``DeviceMesh`` (its ``mesh`` tensor of ranks pairs the tied embeddings' stages)."""

    @property
    def device(self) -> torch.device: ...

    def group(self, dim: str) -> dist.ProcessGroup: ...

    def rank_in(self, dim: str) -> int: ...

    def submesh(self, *dims: str): ...

    def stage_loss(self, lm: nn.Module, batch: Mapping[str, torch.Tensor], num_items) -> torch.Tensor: ...

    def batch_context(self, batch: Mapping[str, torch.Tensor]) -> AbstractContextManager: ...

    def loss_context(self, model: nn.Module | None = None) -> AbstractContextManager: ...


class StageModule(nn.Module):
    """One pipeline stage's forward around its cut model ``lm``: hidden states out, or on the
    last stage the loss from ``loss(lm, batch, num_items)``."""

    def __init__(self, lm: nn.Module, index: int, n_stages: int, loss) -> None:
        super().__init__()
        self.lm = lm
        self.index, self.n_stages = index, n_stages
        self._loss = loss
        self.num_items: torch.Tensor | None = None  # the step's global token count, set per step

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.n_stages - 1

    def forward(
        self, x: torch.Tensor, position_ids: torch.Tensor, shift_labels: torch.Tensor
    ) -> torch.Tensor:
        inputs = {"input_ids": x} if self.is_first else {"inputs_embeds": x}
        if self.is_last:
            return self._loss(
                self.lm,
                {**inputs, "position_ids": position_ids, "shift_labels": shift_labels},
                self.num_items,
            )
        # The decoder's output (its norm is an identity here) is taken by a hook, not as the
        # "logits" the identity LM head returns: those are a view, which the zero-bubble schedules'
        # split backward cannot detach in place.
        captured = {}

        def keep(_module, _args, output):
            captured["hidden"] = (
                output.last_hidden_state if hasattr(output, "last_hidden_state") else output[0]
            )

        handle = self.lm.get_decoder().register_forward_hook(keep)
        try:
            self.lm(**inputs, position_ids=position_ids, use_cache=False, logits_to_keep=1)
        finally:
            handle.remove()
        return captured["hidden"]


def join_micro_batches(micro_batches: Sequence[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The step's micro-batches as one batch of rows, each right-padded to the widest (pad token 0,
    label ignored, positions counting on): padding after a row's tokens changes none of them."""
    width = max(mb["input_ids"].shape[1] for mb in micro_batches)
    out: dict[str, list[torch.Tensor]] = {"input_ids": [], "shift_labels": [], "position_ids": []}
    for mb in micro_batches:
        pad = width - mb["input_ids"].shape[1]
        ids, labels, pos = mb["input_ids"], mb["shift_labels"], mb["position_ids"]
        if pad:
            rows = ids.shape[0]
            ids = torch.cat([ids, ids.new_zeros(rows, pad)], 1)
            labels = torch.cat([labels, labels.new_full((rows, pad), IGNORE_INDEX)], 1)
            pos = torch.cat([pos, pos[:, -1:] + torch.arange(1, pad + 1, device=pos.device)], 1)
        out["input_ids"].append(ids)
        out["shift_labels"].append(labels)
        out["position_ids"].append(pos)
    return {k: torch.cat(v) for k, v in out.items()}


def reduces_once_per_step(unsharded_grad_accumulation: bool | None, pp_enabled: bool) -> bool:
    """``FSDPOptions.unsharded_grad_accumulation`` resolved: ``None`` is on under pipeline parallel
    (one gradient reduction per optimizer step), off otherwise."""
    if unsharded_grad_accumulation is None:
        return pp_enabled
    return unsharded_grad_accumulation


def _shard_root(module: StageModule, runtime: StageRuntime) -> None:
    """Reducing once per step (``reduces_once_per_step``: the default under PP): make the stage
    module the FSDP root over its sharded model (no parameters of its own), so torch's
    ``PipelineStage`` sees an FSDP module: it then skips the gradient reduction in every
    micro-batch's backward and reduces once per step (``perform_reduce_grad``), gradients
    unsharded until then. With ``unsharded_grad_accumulation=False`` (the fallback when they do not
    fit) every micro-batch's backward reduce-scatters (and under HSDP all-reduces)."""
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    if not reduces_once_per_step(runtime.options.fsdp.unsharded_grad_accumulation, pp_enabled=True):
        return
    inner = fsdp_root(module.lm)
    if inner is None or inner is not base_model_of(module.lm):  # not sharded (or only its experts)
        return
    options = runtime.options
    mp = MixedPrecisionPolicy(
        param_dtype=options.param_dtype, reduce_dtype=options.fsdp.reduce_dtype or torch.float32
    )
    fully_shard(
        module, mesh=runtime.submesh(*runtime.dims.fsdp_dims), mp_policy=mp, reshard_after_forward=False
    )
    for m in module.modules():
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(1.0)
            m.set_force_sum_reduction_for_comms(True)


def _ignored(micro_batch: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A micro-batch of the same shape that trains and scores nothing (every label ignored)."""
    return {**micro_batch, "shift_labels": torch.full_like(micro_batch["shift_labels"], IGNORE_INDEX)}


class Pipeline:
    """This rank's stages of a pipeline-parallel model and the schedule that runs them."""

    def __init__(
        self, runtime: StageRuntime, plan: StagePlan, stages: dict[int, nn.Module], tied: bool
    ) -> None:
        self.runtime, self.plan = runtime, plan
        self.modules = {s: StageModule(lm, s, plan.n_stages, runtime.stage_loss) for s, lm in stages.items()}
        for module in self.modules.values():
            _shard_root(module, runtime)
        self.stages = self._new_stages()
        self._stage_sets: dict[int, list] = {}
        self._schedules: dict[tuple[int, int], object] = {}
        self._loss_scale: float | None = None
        self._tied = self._tie_pair(tied)

    # ---------------------------------------------------------------------- where
    @property
    def holds_first(self) -> bool:
        return 0 in self.modules

    @property
    def holds_last(self) -> bool:
        return self.plan.n_stages - 1 in self.modules

    def lms(self) -> list[nn.Module]:
        return [self.modules[s].lm for s in sorted(self.modules)]

    # ---------------------------------------------------------------- tied weights
    def _tie_pair(self, tied: bool):
        """(the copies of the tied weight on this rank, the group summing their gradients) or None."""
        if not tied:
            return None
        first_rank, last_rank = self.plan.rank_of(0), self.plan.rank_of(self.plan.n_stages - 1)
        mine = []
        if self.holds_first:
            mine.append(self.modules[0].lm.get_input_embeddings().weight)
        if self.holds_last:
            mine.append(self.modules[self.plan.n_stages - 1].lm.get_output_embeddings().weight)
        if first_rank == last_rank:  # one rank holds both (ZBV): a local sum
            return mine, None
        if self.plan.pp == 2:
            return mine, self.runtime.group("pp")
        pairs = self.runtime.mesh.mesh  # (pp, ...) ranks: pair stage-0 and last-stage ranks of each pipeline
        firsts, lasts = pairs[first_rank].flatten().tolist(), pairs[last_rank].flatten().tolist()
        group, _ = dist.new_subgroups_by_enumeration([[a, b] for a, b in zip(firsts, lasts)])
        return mine, group

    def _sum_tied_grads(self) -> None:
        if self._tied is None:
            return
        weights, group = self._tied
        grads = [w.grad for w in weights if w.grad is not None]
        local = [g.to_local() if hasattr(g, "to_local") else g for g in grads]
        if group is None:
            if len(local) == 2:
                total = local[0] + local[1]
                local[0].copy_(total)
                local[1].copy_(total)
            return
        for g in local:
            dist.all_reduce(g, group=group)

    def tied_copy_ids(self) -> set[int]:
        """ids of the parameters the gradient norm must not count again: the last stage's copy of
        tied embeddings (its first-stage twin is counted)."""
        if self._tied is None or not self.holds_last:
            return set()
        return {id(self.modules[self.plan.n_stages - 1].lm.get_output_embeddings().weight)}

    # ------------------------------------------------------------------------ step
    def _new_stages(self) -> list:
        from torch.distributed.pipelining import PipelineStage

        group, device, n = self.runtime.group("pp"), self.runtime.device, self.plan.n_stages
        return [PipelineStage(self.modules[s], s, n, device, group=group) for s in sorted(self.modules)]

    def _stages_of(self, width: int) -> list:
        """This rank's torch stages for rows ``width`` tokens wide. A torch stage infers the shapes
        it sends and receives at its first step and keeps them (its receive buffers), so each width
        a run meets gets stages of its own: one width with ``pad_to_sequence_len``, a few buckets
        without (``data/widths.py``; one set of buffers per width). All stages of one pipeline
        read the same rows, so they agree on the width."""
        if width not in self._stage_sets:
            self._stage_sets[width] = self.stages if not self._stage_sets else self._new_stages()
        return self._stage_sets[width]

    def _schedule(self, n_microbatches: int, width: int):
        if (n_microbatches, width) not in self._schedules:
            from torch.distributed.pipelining import schedules

            cls = getattr(schedules, f"Schedule{self.plan.schedule}")
            stages = self._stages_of(width)
            self._schedules[n_microbatches, width] = cls(
                stages if self.plan.virtual > 1 else stages[0],
                n_microbatches=n_microbatches,
                loss_fn=self._loss_fn,
                scale_grads=False,
            )
        return self._schedules[n_microbatches, width]

    def _loss_fn(self, loss: torch.Tensor, _target) -> torch.Tensor:
        return loss * self._loss_scale if self._loss_scale is not None else loss

    def microbatches(self, micro_batches: Sequence[Mapping[str, torch.Tensor]]) -> int:
        """Pipeline micro-batches of a step: ``PipelineOptions.microbatches``, else one per
        accumulation micro-batch."""
        n = self.runtime.options.pipeline.microbatches or len(micro_batches)
        rows = sum(mb["input_ids"].shape[0] for mb in micro_batches)
        if rows % n:
            raise ValueError(
                f"pipeline_microbatches={n} must divide the rows of a step on one dp rank "
                f"({rows} = micro_batch_size × gradient_accumulation_steps)"
            )
        return n

    def forward_backward(
        self,
        micro_batches: Sequence[Mapping[str, torch.Tensor]],
        num_items: torch.Tensor,
        loss_scale: float | None = None,
    ) -> torch.Tensor:
        """Run the step's micro-batches through the schedule (forward and backward) and return this
        rank's share of the step loss (the last stage's sum over its micro-batches, else 0)."""
        self._loss_scale = loss_scale
        total = self._run(micro_batches, num_items, self.microbatches(micro_batches), train=True)
        self._sum_tied_grads()
        return total / loss_scale if loss_scale is not None else total

    def eval_group(self) -> int:
        """Micro-batches per evaluation pass: the training step's pipeline micro-batches (a count
        the schedule accepts), at least the number of stages."""
        return self.runtime.options.pipeline.microbatches or self.plan.pp

    def evaluate(
        self, micro_batches: Sequence[Mapping[str, torch.Tensor]], num_items: torch.Tensor, group: int
    ) -> torch.Tensor:
        """Forward only, ``group`` micro-batches at a time (the last group filled with micro-batches
        whose labels are all ignored): this rank's share of the token-loss sum / ``num_items``."""
        self._loss_scale = None
        total = torch.zeros((), device=self.runtime.device)
        for start in range(0, len(micro_batches), group):
            chunk = list(micro_batches[start : start + group])
            chunk += [_ignored(chunk[-1])] * (group - len(chunk))
            with torch.no_grad():
                total += self._run(chunk, num_items, group, train=False)
        return total

    def _run(self, micro_batches, num_items: torch.Tensor, n: int, train: bool) -> torch.Tensor:
        batch = join_micro_batches(micro_batches)
        for module in self.modules.values():
            module.num_items = num_items
        losses: list[torch.Tensor] = []
        schedule = self._schedule(n, batch["input_ids"].shape[1])
        last_lm = self.modules[self.plan.n_stages - 1].lm if self.holds_last else None
        with self.runtime.batch_context(batch), self.runtime.loss_context(last_lm):
            args = (batch["input_ids"],) if self.holds_first else ()
            target = batch["shift_labels"] if self.holds_last else None
            run = schedule.step if train else schedule.eval
            run(
                *args,
                position_ids=batch["position_ids"],
                shift_labels=batch["shift_labels"],
                target=target,
                losses=losses,
                return_outputs=False,
            )
        total = torch.zeros((), device=self.runtime.device)
        for loss in losses:
            total += loss.detach().float()
        return total


def gather_stage_states(engine: StageRuntime, state: dict) -> dict | None:
    """Every stage's ``state`` (name -> tensor, this rank's stages) merged on pp rank 0 (None on
    the others): a small-model helper for comparisons, not a checkpoint path."""
    group = engine.group("pp")
    first = engine.rank_in("pp") == 0
    out = [None] * engine.dims.pp if first else None
    dist.gather_object(state, out, group=group, group_dst=0)
    if not first:
        return None
    merged: dict = {}
    for part in out:
        merged.update(part)
    return merged
