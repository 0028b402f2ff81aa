"""``Engine``: one process's typed training runtime — the process group, the resolved layout
(``ParallelDims``) and its mesh, the strategy options, and what a training step needs from them
(parallelising models, the layout-invariant loss, CP sharding of a batch, gradient sync, norms).

The trainer, ``verify`` and the equivalence checks drive it directly; the Accelerate-compatible
``Accelerator`` is an adapter over it. Nothing below this layer calls back into either.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import os
import weakref
from collections.abc import Iterable, Mapping, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from ndparallel.engine.model_build import build_model
from ndparallel.engine.records import ParallelModel
from ndparallel.layout.config import ParallelismConfig
from ndparallel.layout.dims import MESH_DIM_NAMES, ParallelDims
from ndparallel.layout.mesh import build_expert_mesh, build_mesh, submesh
from ndparallel.models.adapters import apply_adapter, base_model_of, is_peft_model, trained_shapes
from ndparallel.models.layers import decoder_module
from ndparallel.models.moe import experts_modules
from ndparallel.parallel.cp.context import context_parallel_buffers
from ndparallel.parallel.fsdp import gathered, set_gradient_sync
from ndparallel.parallel.options import StrategyOptions
from ndparallel.parallel.parallelize import parallelize_model
from ndparallel.parallel.pp.schedule import Pipeline
from ndparallel.parallel.pp.split import ZERO_BUBBLE_SCHEDULES, plan_stages, schedule_name
from ndparallel.parallel.pp.stages import (
    StageView,
    cut_stages,
    pipeline_model_problem,
)
from ndparallel.parallel.tp.tensor import resolve_loss_parallel
from ndparallel.runtime.distributed import DistributedInfo, init_distributed
from ndparallel.runtime.quiet import quiet_library_noise
from ndparallel.techniques import lm_loss
from ndparallel.techniques.grad_norm import scale_grads_to, total_grad_norm
from ndparallel.techniques.loss import causal_lm_loss, global_num_items, micro_batch_num_items
from ndparallel.techniques.offload import ActivationOffloader, offloader_of
from ndparallel.techniques.router_loss import aux_loss_term, recording_routers


class Engine:
    """Start (or join) the process group, resolve ``layout`` against its world size, build the
    5-D mesh (pp, dp_replicate, dp_shard, cp, tp; every group with the collective timeout) and hold the
    strategy ``options``.

    ``layout``: a ``ParallelismConfig`` (a -1 degree is filled from the world size) or
    ``ParallelDims``. ``device``: "cpu"/"cuda" (default: ``NDPARALLEL_DEVICE``, else cuda when
    visible). ``timeout_s``: collective timeout of every group (default ``NDPARALLEL_TIMEOUT`` or 600).
    """

    def __init__(
        self,
        layout: ParallelismConfig | ParallelDims,
        options: StrategyOptions = StrategyOptions(),
        *,
        device: str | None = None,
        timeout_s: float | None = None,
    ) -> None:
        quiet_library_noise()  # a Python-API run drops the library lines the command line's do
        self.info: DistributedInfo = init_distributed(device, timeout_s)
        if isinstance(layout, ParallelDims):
            layout = ParallelismConfig(
                dp_replicate_size=layout.dp_replicate,
                dp_shard_size=layout.dp_shard,
                cp_size=layout.cp,
                tp_size=layout.tp,
                ep_size=layout.ep,
                pp_size=layout.pp,
            )
        self.dims: ParallelDims = layout.resolve(self.info.world_size).dims
        across = self.dims.tp_across_nodes(int(os.environ.get("LOCAL_WORLD_SIZE", self.info.world_size)))
        if across:  # several nodes (torchrun --nnodes, accelerate launch --num_machines)
            raise ValueError(across)
        self.mesh = build_mesh(
            self.info.device_type, self.dims.sizes, datetime.timedelta(seconds=self.info.timeout_s)
        )
        self.options = options
        self._submeshes: dict[tuple[str, ...], object] = {}
        self._expert_mesh = None
        self._records: weakref.WeakKeyDictionary[nn.Module, ParallelModel] = weakref.WeakKeyDictionary()
        """One record per model this engine returned (or computed a loss for), keyed by the model."""
        self._offloader: ActivationOffloader | None = None
        """The activation offloader of this rank's models: one host-memory budget for all of them."""

    # ----------------------------------------------------------------------- where
    @property
    def device(self) -> torch.device:
        return self.info.device

    @property
    def rank(self) -> int:
        return self.info.rank

    @property
    def world_size(self) -> int:
        return self.info.world_size

    @property
    def local_rank(self) -> int:
        return self.info.local_rank

    @property
    def is_main_process(self) -> bool:
        return self.info.rank == 0

    @property
    def is_local_main_process(self) -> bool:
        return self.info.local_rank == 0

    def submesh(self, *dims: str):
        """The sub-mesh of base or flattened dim names, e.g. ``submesh("dp_shard_cp")`` (cached:
        slicing a DeviceMesh builds a new one each time)."""
        if dims not in self._submeshes:
            self._submeshes[dims] = submesh(self.mesh, *dims)
        return self._submeshes[dims]

    @property
    def expert_mesh(self):
        """The expert mesh ``(dp_replicate, efsdp, ep)`` (``layout.mesh.build_expert_mesh``), built
        on first use: only a mixture-of-experts model under EP or TP needs its process groups."""
        if self._expert_mesh is None:
            self._expert_mesh = build_expert_mesh(
                self.mesh, self.dims, datetime.timedelta(seconds=self.info.timeout_s)
            )
        return self._expert_mesh

    @property
    def built_expert_mesh(self):
        """The expert mesh if a model needed it (else None; nothing is built)."""
        return self._expert_mesh

    def group(self, dim: str) -> dist.ProcessGroup:
        return self.submesh(dim).get_group()

    def rank_in(self, dim: str) -> int:
        """This rank's index along a mesh dim (``dp``, ``tp``, ``cp``, ``dp_shard_cp``...)."""
        return self.submesh(dim).get_local_rank()

    @property
    def dp_rank(self) -> int:
        return self.rank_in("dp")

    @property
    def dp_size(self) -> int:
        return self.dims.dp

    def print(self, *args, **kwargs) -> None:
        """``print`` on each node's first process only."""
        if self.is_local_main_process:
            print(*args, **kwargs)

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier()

    # ---------------------------------------------------------------------- models
    def parallelize(self, model: nn.Module, adapter=None) -> nn.Module:
        """Apply the layout's strategies to ``model`` (in ``parallelize_model``'s order) and return it;
        ``adapter`` (a peft ``LoraConfig``) wraps it with LoRA first. Training needs no KV cache (with one,
        transformers also skips its packed-document mask): it is switched off. Under pipeline parallel the
        model (with its adapter) is cut into stages first, each parallelised on its own and run by the
        pipeline (``pipeline_of``); the returned ``StageView`` names this rank's stages as the whole (PEFT)
        model does."""
        if self.dims.pp_enabled:
            return self._parallelize_pipeline(model, adapter)
        return self._parallelize_stage(model, adapter)

    def _parallelize_pipeline(self, model: nn.Module, adapter) -> nn.Module:

        if adapter is not None:  # on the whole model: PEFT's names and init are one process's
            model = apply_adapter(model, adapter)
        base = base_model_of(model)
        problem = pipeline_model_problem(
            model, self.dims.cp_enabled, self.options.cp.comm_strategy, self.info.device_type
        )
        if problem:
            raise ValueError(problem)
        plan = plan_stages(self.options.pipeline, self.dims.pp, len(decoder_module(base).layers))
        mine = plan.stages_of(self.rank_in("pp"))
        tied = bool(getattr(base.config, "tie_word_embeddings", False))
        whole = trained_shapes(model) if is_peft_model(model) else None  # adapter files and init: the whole's
        stages = cut_stages(model, {s: plan.layers[s] for s in mine}, plan.n_stages)
        stages = {s: self._parallelize_stage(lm, None) for s, lm in stages.items()}
        view = StageView(stages, whole_trained=whole)
        view.attach(self.group("pp"), all(self.rank_in(d) == 0 for d in MESH_DIM_NAMES))  # for the export
        pipeline = Pipeline(self, plan, stages, tied)
        self._records[view] = ParallelModel.of(view, pipeline=pipeline, _router_spec=None)
        return view

    def record_of(self, model: nn.Module) -> ParallelModel | None:
        """This engine's record of ``model`` (one it returned), else None."""
        return self._records.get(model)

    def pipeline_of(self, model: nn.Module):
        """The ``Pipeline`` running a model this engine cut into stages, else None."""
        record = self._records.get(model)
        return record.pipeline if record is not None else None

    def stage_loss(self, lm: nn.Module, batch: Mapping[str, torch.Tensor], num_items) -> torch.Tensor:
        """The last pipeline stage's loss: ``forward_loss`` of its cut model on the hidden states.
        The zero-bubble schedules run a backward in two passes (input, then weight gradients),
        which the chunked loss's single fused backward cannot: they take the logits path."""

        two_pass = schedule_name(self.options.pipeline.schedule) in ZERO_BUBBLE_SCHEDULES
        return self._token_loss(lm, batch, num_items, chunked=False if two_pass else None)

    def _parallelize_stage(self, model: nn.Module, adapter) -> nn.Module:

        if adapter is not None:
            model = apply_adapter(model, adapter)
        config = getattr(model, "config", None)  # a multimodal model's decoder reads its text_config
        for part in (config, getattr(config, "get_text_config", lambda: None)()):
            if getattr(part, "use_cache", False):
                part.use_cache = False
        options = self.options
        if self.dims.tp_enabled:  # loss_parallel=None: on where exact, decided for this model
            tp = resolve_loss_parallel(base_model_of(model), options.tp)
            options = dataclasses.replace(options, tp=tp)

        moe = bool(experts_modules(base_model_of(model)))  # split over ep (or off tp): expert mesh
        expert_mesh = self.expert_mesh if self.dims.experts_split(moe) else None
        shared = self._offloader
        model = parallelize_model(
            model, self.mesh, self.dims, options, self.device, expert_mesh=expert_mesh, offloader=shared
        )
        self._offloader = self._offloader or offloader_of(model)  # the next stage shares its host budget
        self._records[model] = ParallelModel.of(
            model, loss_parallel=self.dims.tp_enabled and bool(options.tp.loss_parallel)
        )
        return model

    def build_model(self, source, **kwargs) -> nn.Module:
        """A causal LM built on the meta device, parallelised, and filled with this rank's shards
        (``engine.build.build_model``: ``source`` is a model directory / hub id, an HF config or a
        preset name)."""

        return build_model(self, source, **kwargs)

    # ------------------------------------------------------------------------ loss
    def loss_parallel(self, model: nn.Module | None = None) -> bool:
        """Whether ``model``'s logits are vocab-sharded (loss parallel); without a model: whether
        any model this engine parallelised has it (the context is a no-op for plain tensors)."""
        if model is not None:
            record = self._records.get(model)
            return record is not None and record.loss_parallel
        return any(record.loss_parallel for record in self._records.values())

    def loss_context(self, model: nn.Module | None = None):
        """The context the loss forward and backward run in (``loss_parallel`` under TP)."""
        if self.loss_parallel(model):
            from torch.distributed.tensor.parallel import loss_parallel

            return loss_parallel()
        return contextlib.nullcontext()

    def global_num_items(
        self, micro_batches: Iterable[Mapping[str, torch.Tensor]], label_key: str = "shift_labels"
    ) -> torch.Tensor:
        """Non-ignored label tokens of this optimizer step over all micro-batches and dp ranks
        (counted before CP sharding), an int64 tensor on the device (no host sync)."""

        return global_num_items(micro_batches, self.group("dp"), label_key, self.device)

    def micro_batch_num_items(
        self, micro_batches: Sequence[Mapping[str, torch.Tensor]], label_key: str = "shift_labels"
    ) -> list[torch.Tensor]:
        """Each micro-batch's divisor under ``loss_reduction: micro_batch_mean``: its own token count
        × the micro-batches over the dp ranks (Axolotl's mean of the micro-batches' token means)."""

        return micro_batch_num_items(micro_batches, self.group("dp"), label_key, self.device)

    def causal_lm_loss(self, logits: torch.Tensor, shift_labels: torch.Tensor, num_items) -> torch.Tensor:
        """Token-loss sum of this rank / the global token count."""

        with self.loss_context():
            return causal_lm_loss(logits, shift_labels, num_items)

    def router_aux_spec(self, model: nn.Module):
        """The ``MoESpec`` of a mixture-of-experts model whose training loss includes the routers'
        load-balancing loss (transformers' ``output_router_logits``), else None."""
        record = self._records.get(model)
        if record is None:  # a model the engine did not parallelise (read once, like the others)
            record = self._records[model] = ParallelModel.of(model)
        return record.router_spec()

    def forward_loss(
        self,
        model: nn.Module,
        batch: Mapping[str, torch.Tensor],
        num_items,
        aux_weight: float = 1.0,
        aux_values: list | None = None,
    ) -> torch.Tensor:
        """Forward ``batch`` (``input_ids``, ``shift_labels``, ``position_ids``; CP-sharded
        already) and return this rank's token-loss sum / the global token count: the chunked loss
        (no full logits) where exact (``LossOptions``), else the logits and ``causal_lm_loss``.
        A mixture-of-experts model with ``output_router_logits`` adds its routers' load-balancing
        loss × ``router_aux_loss_coef`` × ``aux_weight`` (``techniques/router_loss.py``: global over
        the micro-batch, layout-invariant); its global value is appended to ``aux_values``."""
        spec = self.router_aux_spec(model)
        if spec is None:
            return self._token_loss(model, batch, num_items)

        with recording_routers(model, spec, batch.get("attention_mask")) as stats:
            loss = self._token_loss(model, batch, num_items)
        rows_split_on_tp = self.dims.tp_enabled and self.options.tp.sequence_parallel
        group = dist.group.WORLD if rows_split_on_tp else self.group("dp_cp")
        term, value = aux_loss_term(stats, group, self.dims.dp * self.dims.cp)
        if aux_values is not None:
            aux_values.append(value.detach() * aux_weight)
        return loss + (spec.aux_loss_coef * aux_weight) * term.to(loss.dtype)

    def _token_loss(
        self, model: nn.Module, batch: Mapping[str, torch.Tensor], num_items, chunked: bool | None = None
    ) -> torch.Tensor:

        if chunked is not False and lm_loss.use_chunked_loss(model, self.options.loss):
            sp = self.dims.tp_enabled and self.options.tp.sequence_parallel
            return lm_loss.forward_loss(
                model,
                batch,
                num_items,
                self.options.loss.chunk_tokens,
                sequence_parallel=sp,
                gathered=gathered,
            )
        logits = model(**lm_loss.model_inputs(batch)).logits

        with self.loss_context(model):
            return causal_lm_loss(logits, batch["shift_labels"], num_items)

    def backward(self, loss: torch.Tensor, model: nn.Module | None = None, **kwargs) -> None:
        with self.loss_context(model):
            loss.backward(**kwargs)

    def reduce_step_loss(self, loss_sum: torch.Tensor) -> torch.Tensor:
        """This rank's share of the step loss summed over the dp×cp ranks (tp peers hold the same
        share): the global mean token loss, in place, on every rank."""
        if self.dims.size("dp_cp") > 1:
            dist.all_reduce(loss_sum, group=self.group("dp_cp"))
        if self.dims.pp_enabled:  # only the last stage has a loss: sent to the other stages
            dist.all_reduce(loss_sum, group=self.group("pp"))
        return loss_sum

    # -------------------------------------------------------------------- batches
    @contextlib.contextmanager
    def cp_shard(
        self,
        buffers: Sequence[torch.Tensor],
        seq_dims: Sequence[int] | None = None,
        no_restore: set | None = None,
    ):
        """Shard ``buffers`` IN PLACE along their sequence dims over the cp group for the block
        (load-balanced for causal attention), restored after; a no-op without CP."""
        if not self.dims.cp_enabled:
            yield list(buffers)
            return

        dims = list(seq_dims or [1] * len(buffers))
        with context_parallel_buffers(
            self.submesh("cp"),
            list(buffers),
            dims,
            no_restore_buffers=no_restore,
            load_balance=self.options.cp.load_balance,
        ) as out:
            yield out

    def seq_len_divisor(self) -> int:
        """What every sequence length must be a multiple of under this layout and its options
        (``ParallelDims.seq_len_divisor``: CP's chunks, cp·tp under sequence parallel)."""
        return self.dims.seq_len_divisor(self.options.tp.sequence_parallel, self.options.cp.load_balance)

    def batch_context(self, batch: Mapping[str, torch.Tensor]):
        """``cp_shard`` of a training batch's ``input_ids``, ``shift_labels`` and ``position_ids``."""
        return self.cp_shard([batch["input_ids"], batch["shift_labels"], batch["position_ids"]])

    # ------------------------------------------------------------------- gradients
    def set_grad_sync(self, model: nn.Module, enabled: bool) -> None:
        """Reduce gradients in the next backward passes (``enabled``) or only reduce-scatter them
        (gradient accumulation; with ``unsharded_grad_accumulation`` not even that)."""

        keep_rs = not self.options.fsdp.unsharded_grad_accumulation
        set_gradient_sync(model, enabled, keep_reduce_scatter=keep_rs)

    def clip_grad_norm_(
        self, parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2.0
    ) -> torch.Tensor:
        """Clip to ``max_norm``; returns the true global norm (any layout, any mix of meshes, every
        pipeline stage)."""

        parameters = list(parameters)
        total = self.grad_norm(parameters, norm_type)
        scale_grads_to(parameters, total, max_norm)
        return total

    def grad_norm(self, parameters: Iterable[torch.Tensor], norm_type: float = 2.0) -> torch.Tensor:
        """The global gradient norm; under pipeline parallel over every stage, each weight once
        (the last stage's copy of tied embeddings is not counted again)."""

        if not self.dims.pp_enabled:
            return total_grad_norm(parameters, norm_type, device=self.device)
        pipelines = [record.pipeline for record in self._records.values() if record.pipeline is not None]
        copies = {i for pipeline in pipelines for i in pipeline.tied_copy_ids()}
        counted = [p for p in parameters if id(p) not in copies]
        return total_grad_norm(counted, norm_type, stages=self.dims.pp, device=self.device)
