"""``Accelerator``: the user-facing facade. It holds the mesh and the options and calls the strategy
modules in ``ndparallel.parallel``; it contains no parallel algorithm itself.

Names mirror Hugging Face Accelerate's so a script written for it ports by changing the import.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterable, Mapping, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from ndparallel.layout.config import ParallelismConfig
from ndparallel.layout.mesh import submesh
from ndparallel.parallel.options import CPOptions, FSDPOptions, TPOptions
from ndparallel.runtime.distributed import DistributedInfo, init_distributed

_MIXED_PRECISION = {"no": None, "fp32": None, "bf16": torch.bfloat16}


class Accelerator:
    """Set up the process group and mesh for a layout and prepare models, optimizers and loaders.

    Args:
        parallelism_config: the layout; default: data parallel over every rank (like Accelerate).
        mixed_precision: "no"/"fp32" (fp32 throughout) or "bf16" (bf16 compute, fp32 master weights
            and gradient reduction). "fp16" is refused: it needs loss scaling, not implemented.
        gradient_accumulation_steps: micro-batches per optimizer step (see ``accumulate``).
        fsdp_options / tp_options / cp_options: per-strategy options.
        device: "cpu" or "cuda" (default: cuda when visible).
        timeout_s: collective timeout; a dead peer fails the job after this long.
    """

    def __init__(
        self,
        parallelism_config: ParallelismConfig | None = None,
        mixed_precision: str = "no",
        gradient_accumulation_steps: int = 1,
        fsdp_options: FSDPOptions | None = None,
        tp_options: TPOptions | None = None,
        cp_options: CPOptions | None = None,
        device: str | None = None,
        timeout_s: float | None = None,
    ) -> None:
        if mixed_precision == "fp16":
            raise ValueError(
                "mixed_precision='fp16' needs loss scaling (a gradient scaler), which ndparallel does not "
                "implement: use 'bf16' (as fast on Ampere and newer GPUs, and no scaling needed)"
            )
        if mixed_precision not in _MIXED_PRECISION:
            raise ValueError(
                f"mixed_precision={mixed_precision!r} is not supported: use one of {list(_MIXED_PRECISION)}"
            )
        if int(gradient_accumulation_steps) < 1:
            raise ValueError(f"gradient_accumulation_steps must be >= 1, got {gradient_accumulation_steps}")
        self.info: DistributedInfo = init_distributed(device, timeout_s)
        pc = parallelism_config or ParallelismConfig()
        if parallelism_config is None and pc.active_dims == () and self.info.world_size > 1:
            pc = ParallelismConfig(dp_replicate_size=-1)
        self.parallelism_config = pc.resolve(self.info.world_size)
        self.mixed_precision = mixed_precision
        self.gradient_accumulation_steps = int(gradient_accumulation_steps)
        self.fsdp_options = fsdp_options or FSDPOptions()
        self.tp_options = tp_options or TPOptions()
        self.cp_options = cp_options or CPOptions()
        self.torch_device_mesh = self.parallelism_config.build_device_mesh(
            self.info.device_type, timeout_s=self.info.timeout_s)
        self._param_remap: dict[int, nn.Parameter] = {}
        self._models: list[nn.Module] = []
        self._optimizers: list[torch.optim.Optimizer] = []
        self._schedulers: list[Any] = []  # tracked for save_state / load_state
        self.step = 0  # micro-batches seen by ``accumulate``

    # ------------------------------------------------------------------ ranks
    @property
    def device(self) -> torch.device:
        return self.info.device

    @property
    def process_index(self) -> int:
        return self.info.rank

    @property
    def num_processes(self) -> int:
        return self.info.world_size

    @property
    def local_process_index(self) -> int:
        return self.info.local_rank

    @property
    def is_main_process(self) -> bool:
        return self.info.rank == 0

    @property
    def is_local_main_process(self) -> bool:
        return self.info.local_rank == 0

    def mesh(self, *dims: str):
        """Sub-mesh for base or flattened dim names, e.g. ``acc.mesh("dp_shard_cp")``."""
        return submesh(self.torch_device_mesh, *dims)

    def rank_in(self, dim: str) -> int:
        """This rank's index along a mesh dim (``dp``, ``tp``, ``cp``, ``dp_shard_cp``...)."""
        return self.mesh(dim).get_local_rank()

    @property
    def dp_rank(self) -> int:
        return self.rank_in("dp")

    @property
    def dp_size(self) -> int:
        return self.parallelism_config.dp_size

    @property
    def param_dtype(self) -> torch.dtype | None:
        return _MIXED_PRECISION[self.mixed_precision]

    # --------------------------------------------------------------- prepare
    def prepare(self, *objects: Any) -> Any:
        """Parallelise models, remap optimizers created before ``prepare`` onto the new parameters,
        shard plain ``DataLoader``s over the dp ranks; schedulers pass through (they keep pointing
        at the same, remapped, optimizer). Returns the objects in the order given."""
        from torch.optim import Optimizer
        from torch.utils.data import DataLoader

        from ndparallel.models.adapters import is_adapter_config

        out = list(objects)
        adapter = next((o for o in out if is_adapter_config(o)), None)  # e.g. a peft LoraConfig
        for i, obj in enumerate(out):
            if isinstance(obj, nn.Module):
                out[i] = self.prepare_model(obj, adapter=adapter)
        for i, obj in enumerate(out):
            if isinstance(obj, Optimizer) and adapter is not None:
                raise ValueError("prepare got an optimizer together with a LoRA config: the optimizer holds "
                                 "the base weights LoRA freezes; prepare the model first, then build the "
                                 "optimizer from the returned model's parameters")
            if isinstance(obj, Optimizer):
                self._remap_optimizer(obj)
                self._optimizers.append(obj)
            elif hasattr(obj, "step") and hasattr(obj, "get_last_lr"):  # an LR scheduler
                self._schedulers.append(obj)
            elif isinstance(obj, DataLoader):
                from ndparallel.data.dataloader_sharding import shard_dataloader

                out[i] = shard_dataloader(obj, self.dp_rank, self.dp_size, self.device)
        return out[0] if len(out) == 1 else tuple(out)

    def prepare_model(self, model: nn.Module, adapter: Any = None) -> nn.Module:
        """Apply TP → CP attention → activation checkpointing → FSDP/HSDP/DP, in that order.
        A model this Accelerator already prepared (e.g. from ``load_model``) is returned as is.
        ``adapter`` (a peft ``LoraConfig``) wraps the model with LoRA first and returns the
        ``PeftModel``; a ``PeftModel`` passed in is parallelised as is (see ``docs/lora.md``)."""
        from ndparallel.parallel.parallelize import parallelize_model

        if any(model is m for m in self._models):
            return model
        if adapter is not None:
            from ndparallel.models.adapters import apply_adapter

            model = apply_adapter(model, adapter)

        old = {id(p): name for name, p in model.named_parameters(remove_duplicate=False)}
        model = parallelize_model(
            model,
            self.torch_device_mesh,
            self.parallelism_config,
            fsdp=self.fsdp_options,
            tp=self.tp_options,
            cp=self.cp_options,
            param_dtype=self.param_dtype,
            device=self.device,
        )
        new = dict(model.named_parameters(remove_duplicate=False))
        for pid, name in old.items():
            if name in new:
                self._param_remap[pid] = new[name]
        self._models.append(model)
        return model

    def _remap_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        if any(optimizer.state.values()):
            raise ValueError(
                "the optimizer already holds state (it has stepped): create it, or call prepare, "
                "before the first optimizer.step()"
            )
        for group in optimizer.param_groups:
            group["params"] = [self._param_remap.get(id(p), p) for p in group["params"]]

    # ----------------------------------------------------- loss and backward
    def global_num_items(
        self, micro_batches: Iterable[Mapping[str, torch.Tensor]], label_key: str = "shift_labels"
    ) -> int:
        """Non-ignored label tokens of this optimizer step over all micro-batches and dp ranks
        (count *before* CP sharding). Divide each micro-batch's token-loss sum by this."""
        from ndparallel.parallel.loss import global_num_items

        return global_num_items(micro_batches, self.mesh("dp").get_group(), label_key, self.device)

    def loss_context(self):
        """The context the loss forward and backward must run in (``loss_parallel`` under TP)."""
        if self.parallelism_config.tp_enabled and self.tp_options.loss_parallel:
            from ndparallel.parallel.tensor import loss_parallel_context

            return loss_parallel_context(self.tp_options)
        return contextlib.nullcontext()

    def causal_lm_loss(
        self, logits: torch.Tensor, shift_labels: torch.Tensor, num_items_in_batch: int
    ) -> torch.Tensor:
        """Token-loss sum of this rank / the global token count (see ``global_num_items``)."""
        from ndparallel.parallel.loss import causal_lm_loss

        with self.loss_context():
            return causal_lm_loss(logits, shift_labels, num_items_in_batch)

    def backward(self, loss: torch.Tensor, num_items_in_batch: int | None = None, **kwargs) -> None:
        """Back-propagate ``loss``.

        With ``num_items_in_batch`` the loss is taken as already divided by the global token count
        (``causal_lm_loss``) and back-propagated as is: gradients are then layout-invariant.
        Without it (Accelerate's habit, e.g. ``model(**batch).loss``) the loss is a per-rank mean:
        it is divided by the accumulation steps and the number of dp×cp ranks, so the summed
        gradient is the mean over ranks and micro-batches, as with DDP."""
        if num_items_in_batch is None:
            pc = self.parallelism_config
            loss = loss / (self.gradient_accumulation_steps * pc.dp_size * pc.cp_size)
        with self.loss_context():
            loss.backward(**kwargs)

    @contextlib.contextmanager
    def accumulate(self, *models: nn.Module):
        """Gradient accumulation: on all but every ``gradient_accumulation_steps``-th micro-batch the
        replica all-reduce is skipped; gradients are still reduce-scattered so they stay sharded,
        unless ``FSDPOptions.unsharded_grad_accumulation`` (then nothing is reduced until the last)."""
        from ndparallel.parallel.fsdp import set_gradient_sync

        self.step += 1
        sync = self.sync_gradients
        keep_rs = not self.fsdp_options.unsharded_grad_accumulation
        for m in models or self._models:
            set_gradient_sync(m, sync, keep_reduce_scatter=keep_rs)
        try:
            yield
        finally:
            for m in models or self._models:
                set_gradient_sync(m, True)

    @property
    def sync_gradients(self) -> bool:
        """True on the last micro-batch of an accumulation cycle."""
        return self.step % self.gradient_accumulation_steps == 0

    @contextlib.contextmanager
    def no_sync(self, model: nn.Module):
        """Skip all gradient reduction for the backward passes inside the block (gradients
        accumulate unsharded until a backward outside it)."""
        from ndparallel.parallel.fsdp import set_gradient_sync

        set_gradient_sync(model, False)
        try:
            yield
        finally:
            set_gradient_sync(model, True)

    def clip_grad_norm_(self, parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2.0):
        """Clip to ``max_norm``; returns the true global norm (any layout, any mix of meshes)."""
        from ndparallel.parallel.grad_norm import clip_grad_norm_

        return clip_grad_norm_(parameters, max_norm, norm_type)

    def grad_norm(self, parameters: Iterable[torch.Tensor], norm_type: float = 2.0) -> torch.Tensor:
        """The global gradient norm without clipping."""
        from ndparallel.parallel.grad_norm import total_grad_norm

        return total_grad_norm(parameters, norm_type)

    # ------------------------------------------------------ context parallel
    def maybe_context_parallel(
        self,
        buffers: Sequence[torch.Tensor] | None = None,
        buffer_seq_dims: Sequence[int] | None = None,
        no_restore_buffers: set[torch.Tensor] | None = None,
    ):
        """Shard ``buffers`` along their sequence dims over the cp group for the block (load-balanced
        for causal attention) when CP is enabled; a no-op context otherwise."""
        if not self.parallelism_config.cp_enabled or not buffers:
            return contextlib.nullcontext()
        from ndparallel.parallel.context import context_parallel_buffers

        return context_parallel_buffers(
            self.mesh("cp"), list(buffers), list(buffer_seq_dims or [1] * len(buffers)),
            no_restore_buffers=no_restore_buffers, load_balance=self.cp_options.load_balance,
        )

    # ------------------------------------------------------------- utilities
    def print(self, *args, **kwargs) -> None:
        """``print`` on the main process only."""
        if self.is_main_process:
            print(*args, **kwargs)

    def wait_for_everyone(self) -> None:
        dist.barrier()

    def reduce(self, tensor: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
        """Sum or mean of ``tensor`` over all ranks (a new tensor)."""
        if reduction not in ("sum", "mean"):
            raise ValueError(f"reduction must be 'sum' or 'mean', got {reduction!r}")
        out = tensor.detach().clone()
        dist.all_reduce(out)
        return out / self.num_processes if reduction == "mean" else out

    def gather_for_metrics(self, tensor: torch.Tensor) -> torch.Tensor:
        """Concatenate ``tensor`` (dim 0) from every dp rank, in dp-rank order. tp/cp peers hold the
        same samples, so gathering over ``dp`` (not the whole world) counts each sample once.
        Every dp rank must pass the same shape (the loaders here drop uneven remainders)."""
        group = self.mesh("dp").get_group()
        parts = [torch.empty_like(tensor) for _ in range(self.dp_size)]
        dist.all_gather(parts, tensor.contiguous(), group=group)
        return torch.cat(parts, dim=0)

    # ------------------------------------------------------- models on disk
    def load_model(self, path_or_config, **kwargs) -> nn.Module:
        """Build the model on the meta device, parallelise it, then read only this rank's shards
        from the safetensors files (DCP resharding). ``path_or_config``: an HF model dir, an HF
        config, or a built-in preset name (random init, same on every rank). ``adapter=LoraConfig``
        returns a LoRA ``PeftModel`` over the frozen, sharded base."""
        from ndparallel.models.loading import load_model

        return load_model(self, path_or_config, **kwargs)

    def save_model(self, model: nn.Module, save_directory: str, tokenizer=None, *,
                   dtype: torch.dtype | None = None) -> None:
        """Write a consolidated Hugging Face directory (safetensors + config [+ tokenizer]), one
        tensor gathered at a time; ``dtype`` casts floating tensors (default: as trained)."""
        from ndparallel.checkpoint.export import save_hf_model

        save_hf_model(model, save_directory, is_main=self.is_main_process, tokenizer=tokenizer, dtype=dtype)
        self.wait_for_everyone()

    def save_state(self, output_dir: str, **kwargs):
        """Sharded checkpoint (DCP) of the prepared models, optimizers (+ schedulers, loaders, RNG)
        into ``output_dir``, marked complete only once every rank has written. Any layout can load it."""
        from ndparallel.checkpoint import save_state

        return save_state(self, output_dir, **kwargs)

    def load_state(self, input_dir: str, **kwargs) -> dict:
        """Load a ``save_state`` checkpoint into the prepared objects, resharding to this layout."""
        from ndparallel.checkpoint import load_state

        return load_state(self, input_dir, **kwargs)

    def end_training(self) -> None:
        """Destroy the process group."""
        from ndparallel.runtime.distributed import shutdown

        shutdown()
