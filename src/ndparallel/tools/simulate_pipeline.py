"""``ndparallel simulate`` of a pipeline-parallel world: this rank's stages run their micro-batches
directly, in the order the schedule gives this rank.

torch's schedules cannot run over the fake backend: at its first step a stage learns its peers'
tensor shapes by receiving pickled metadata (``recv_object_list``), and a fake receive delivers
nothing (seen with torch 2.13: a size of garbage, then an allocation of ~94 TB or a symbolic-size
error). The tensor P2P itself (``isend`` / ``irecv``, ``batch_isend_irecv``) does run: it returns
the buffer untouched. So the simulated rank runs the engine's own stage modules (cut, parallelised
under the fake mesh, the real last-stage loss) through ``DirectSchedule``: the schedule's compute
actions for this rank (GPipe and 1F1B written out as torch runs them; torch's own action list,
``pipeline_order``, for the multi-stage schedules), a forward keeping its graph until that micro-
batch's backward, so the activations in flight are the schedule's. Inputs a stage would receive
are random hidden states of the shape the previous stage sends, the output gradients ones. A stage
that is an FSDP root (``unsharded_grad_accumulation``) is handled as ``PipelineStage`` handles it:
no reduction in its backwards, one ``perform_reduce_grad`` after the step's.

Not modelled: the P2P receive buffers (one activation per micro-batch and boundary in flight), and
the zero-bubble schedules' split backward: an input-gradient action (I) runs the whole backward,
its weight-gradient action (W) nothing, so the weight-gradient intermediates torch holds between
them are not counted. The compute time is this rank's alone: no bubble, no transfer.
"""

from __future__ import annotations

import torch

from ndparallel.engine.model_build import fill_random, materialize_shards
from ndparallel.models.loading import build_on_meta_from_config, init_non_persistent_buffers
from ndparallel.parallel.pp.schedule import join_micro_batches
from ndparallel.parallel.pp.split import bubble_fraction

SINGLE = {"GPipe", "1F1B"}
COMPUTE = {"F", "B", "I", "W"}


def build_random_stages(
    engine, config, dtype: torch.dtype, attn_implementation: str, trust_remote_code: bool
) -> torch.nn.Module:
    """``engine.build.build_random_shards`` for a pipeline layout: this rank's stages built on the
    meta device, parallelised, materialised with random values; each stage's cut model
    materialised and its rotary buffers computed on its own (the ``StageView`` holds one copy of
    them and has no ``_init_weights``)."""

    view = engine.parallelize(
        build_on_meta_from_config(config, dtype, attn_implementation, trust_remote_code, None)
    )
    lms = engine.pipeline_of(view).lms()
    for lm in lms:  # each stage: the view keeps one copy of the rotary buffers of a rank's stages
        materialize_shards(engine, lm)
    fill_random(view)
    for lm in lms:
        init_non_persistent_buffers(lm)
    return view


def rank_actions(pipeline, pp_rank: int, n: int) -> list[tuple[str, int, int]]:
    """(kind, stage, micro-batch) of this rank's compute actions in one step, in order: kind
    'F' forward, 'B' full backward, 'I' / 'W' the zero-bubble schedules' input / weight passes."""
    plan = pipeline.plan
    if plan.schedule in SINGLE:
        (s,) = plan.stages_of(pp_rank)
        if plan.schedule == "GPipe":
            return [("F", s, i) for i in range(n)] + [("B", s, i) for i in range(n)]
        warmup = min(n, plan.n_stages - s)  # torch's Schedule1F1B: warm-up, then B/F pairs, cool-down
        out, f = [("F", s, i) for i in range(warmup)], warmup
        for b in range(n):
            out.append(("B", s, b))
            if f < n:
                out.append(("F", s, f))
                f += 1
        return out
    from torch.distributed.pipelining import schedules

    cls = getattr(schedules, f"Schedule{plan.schedule}")
    order = cls(
        pipeline.stages, n_microbatches=n, loss_fn=lambda loss, _target: loss, scale_grads=False
    ).pipeline_order[pp_rank]
    out = []
    for action in order:
        kind = getattr(action, "computation_type", None)
        kind = getattr(kind, "value", kind)
        if action is not None and kind in COMPUTE:
            out.append((kind, action.stage_index, action.microbatch_index))
    return out


class DirectSchedule:
    """Stands in for ``Pipeline.forward_backward`` on a simulated rank (``install``)."""

    def __init__(self, engine, pipeline) -> None:
        self.engine, self.pipeline = engine, pipeline
        self._actions: dict[int, list] = {}

    def install(self) -> None:
        self.pipeline.forward_backward = self.forward_backward  # this object only, this process only

    def actions(self, n: int) -> list[tuple[str, int, int]]:
        if n not in self._actions:
            self._actions[n] = rank_actions(self.pipeline, self.engine.rank_in("pp"), n)
        return self._actions[n]

    def _received(self, module, like: torch.Tensor) -> torch.Tensor:
        """The hidden states a stage would receive for a micro-batch of ``like``'s rows and tokens."""
        config = module.lm.config
        hidden = getattr(config, "get_text_config", lambda: config)().hidden_size
        dtype = self.engine.options.param_dtype or next(module.lm.parameters()).dtype
        rows, tokens = like.shape
        dims = self.engine.dims
        if dims.tp_enabled and self.engine.options.tp.sequence_parallel:  # stages pass their sequence shard
            tokens //= dims.tp
        x = torch.randn(rows, tokens, hidden, device=self.engine.device, dtype=dtype)
        return x.requires_grad_()

    def forward_backward(self, micro_batches, num_items: torch.Tensor, loss_scale: float | None = None):

        pipeline, engine = self.pipeline, self.engine
        n = pipeline.microbatches(micro_batches)
        batch = join_micro_batches(micro_batches)
        for module in pipeline.modules.values():
            module.num_items = num_items
        last = pipeline.plan.n_stages - 1
        total = torch.zeros((), device=engine.device)
        with (
            engine.batch_context(batch),
            engine.loss_context(pipeline.modules[last].lm if last in pipeline.modules else None),
        ):
            chunks = {
                k: torch.tensor_split(batch[k], n) for k in ("input_ids", "position_ids", "shift_labels")
            }
            kept: dict[tuple[int, int], torch.Tensor] = {}
            for kind, stage, mb in self.actions(n):
                module = pipeline.modules[stage]
                if kind == "F":
                    ids = chunks["input_ids"][mb]
                    x = ids if module.is_first else self._received(module, ids)
                    out = module(
                        x, position_ids=chunks["position_ids"][mb], shift_labels=chunks["shift_labels"][mb]
                    )
                    kept[(stage, mb)] = out
                    if module.is_last:
                        total += out.detach().float()
                elif kind in ("B", "I"):
                    out = kept.pop((stage, mb))
                    _no_sync(module)
                    if module.is_last:
                        (out * loss_scale if loss_scale is not None else out).backward()
                    else:
                        out.backward(torch.ones_like(out))
        for stage in pipeline.stages:  # what torch's schedules do after a stage's last backward
            stage.perform_reduce_grad(1)
        tied_sum = getattr(pipeline, "_sum_tied_grads", None)  # the tied-embedding all-reduce (fake)
        if tied_sum is not None:
            tied_sum()
        return total


def _no_sync(module) -> None:
    """What ``PipelineStage`` does before a backward of a stage that is itself an FSDP module
    (``unsharded_grad_accumulation``): no gradient reduction, no reshard, until the step's
    ``perform_reduce_grad``. Other stages reduce in their own backward, as FSDP does."""
    from torch.distributed.fsdp import FSDPModule

    if isinstance(module, FSDPModule):
        module.set_is_last_backward(False)
        module.set_reshard_after_backward(False)
        module.set_requires_gradient_sync(False)


def pipeline_report(trainer, measured: dict) -> dict:
    """This rank's place in the pipeline and the schedule's idle share: the measured compute time
    has no bubble, so the step estimate divides it by (1 − bubble)."""

    engine = trainer.engine
    pipeline = engine.pipeline_of(trainer.model)
    plan = pipeline.plan
    n = engine.options.pipeline.microbatches or trainer.cfg.gradient_accumulation_steps
    stages = plan.stages_of(engine.rank_in("pp"))
    bubble = bubble_fraction(plan, n)
    return {
        "schedule": plan.schedule,
        "pp": plan.pp,
        "virtual_stages": plan.virtual,
        "pp_rank": engine.rank_in("pp"),
        "stages": stages,
        "layers": {s: list(plan.layers[s]) for s in stages},
        "first_stage": pipeline.holds_first,
        "last_stage": pipeline.holds_last,
        "microbatches": n,
        "bubble": bubble,
        "step_time_with_bubble_s": measured["step_time_s"] / (1.0 - bubble),
        "run": "direct: this rank's stages, the schedule's action order (torch's schedules need their peers' "
        "metadata, which a fake receive does not deliver)",
    }
