"""``Accelerator``: Hugging Face Accelerate's surface as an adapter over ndparallel's ``Engine``.
It maps Accelerate's arguments, plugins and handlers onto the engine's layout and strategy options
and adds what is Accelerate's own (prepared optimizer/scheduler/loader wrappers, accumulation
state, trackers, ``save_state`` naming, hooks); every parallel step is the engine's. Its methods
are grouped by concern in the mixins it is assembled from (processes, collectives, stepping,
context parallelism, saving, tracking)."""

from __future__ import annotations

import os
from collections import OrderedDict
from typing import Any

import torch
import torch.nn as nn

from ndparallel.accelerator import arguments
from ndparallel.accelerator.accelerator_state import (
    AcceleratorState,
    DistributedType,
    GradientState,
)
from ndparallel.accelerator.collectives import CollectivesMixin
from ndparallel.accelerator.context_parallel import ContextParallelMixin
from ndparallel.accelerator.handlers import GradScalerKwargs
from ndparallel.accelerator.preparing import (
    prepare_all,
    prepare_data_loader,
    prepare_model,
    prepare_optimizer,
    prepare_scheduler,
    register_model,
)
from ndparallel.accelerator.processes import ProcessesMixin
from ndparallel.accelerator.saving import SavingMixin
from ndparallel.accelerator.stepping import SteppingMixin
from ndparallel.accelerator.tracking import TrackingMixin, filter_trackers
from ndparallel.accelerator.wrappers import AcceleratedOptimizer, PreparedDataLoader
from ndparallel.engine import Engine
from ndparallel.layout.config import ParallelismConfig
from ndparallel.parallel.options import ActivationOptions, CPOptions, FSDPOptions, StrategyOptions, TPOptions
from ndparallel.techniques.technique_options import CompileOptions, Float8Options, LossOptions, QATOptions


class Accelerator(
    ProcessesMixin, CollectivesMixin, SteppingMixin, ContextParallelMixin, SavingMixin, TrackingMixin
):
    """Set up the process group and mesh for a layout and prepare models, optimizers and loaders.

    The first 21 arguments are Hugging Face Accelerate's, in its order and with its defaults and
    environment variables (docs/accelerate.md's API table says what each maps to). The
    keyword-only rest are ndparallel's: ``fsdp_options`` / ``tp_options`` / ``cp_options`` (the
    strategies' options; ``fsdp_plugin`` / ``parallelism_config.cp_handler`` map onto them),
    ``activation_options`` (activation checkpointing and its policy, offloading, the tiled MLP;
    ``fsdp_plugin.activation_checkpointing`` maps onto it),
    ``loss_options`` (the chunked loss, on where exact), ``compile_options`` (regional compile; also
    from ``dynamo_backend``/``dynamo_plugin``), ``float8_options`` (fp8 linears, SM >= 8.9),
    ``qat_options`` (quantisation-aware training: torchao fake quantisation, ``techniques/qat.py``),
    ``device`` ("cpu"/"cuda"; default cuda when visible) and ``timeout_s`` (collective timeout).
    ``Accelerator(ParallelismConfig(...))`` (the layout as first positional argument) also works.
    ``mixed_precision``: "no" (fp32), "bf16" (bf16 compute, fp32 master weights; gradients reduced
    in fp32 unless ``fsdp_plugin.mixed_precision_policy`` says otherwise), "fp16" (the same in fp16,
    with dynamic loss scaling: ``GradScalerKwargs``; ``accelerator.scaler``).
    """

    def __init__(
        self,
        device_placement: bool = True,
        split_batches: Any = arguments.UNSET,
        mixed_precision: str | None = None,
        gradient_accumulation_steps: int = 1,
        cpu: bool = False,
        dataloader_config=None,
        deepspeed_plugin=None,
        fsdp_plugin=None,
        torch_tp_plugin=None,
        megatron_lm_plugin=None,
        rng_types=None,
        log_with=None,
        project_dir=None,
        project_config=None,
        gradient_accumulation_plugin=None,
        step_scheduler_with_optimizer: bool = True,
        kwargs_handlers=None,
        dynamo_backend=None,
        dynamo_plugin=None,
        deepspeed_plugins=None,
        parallelism_config: ParallelismConfig | None = None,
        *,
        fsdp_options: FSDPOptions | None = None,
        activation_options: ActivationOptions | None = None,
        tp_options: TPOptions | None = None,
        cp_options: CPOptions | None = None,
        loss_options: LossOptions | None = None,
        compile_options: CompileOptions | None = None,
        float8_options: Float8Options | None = None,
        qat_options: QATOptions | None = None,
        device: str | None = None,
        timeout_s: float | None = None,
    ) -> None:
        args = dict(locals())
        args.pop("self")
        if isinstance(device_placement, ParallelismConfig):  # ndparallel's positional form
            if parallelism_config is not None:
                raise TypeError("parallelism_config given twice (positionally and by name)")
            args["parallelism_config"], args["device_placement"] = device_placement, True
        s = arguments.resolve(args)
        self._start_engine(s)
        self._settings = s
        self._take_settings(s)
        ga = s.gradient_state_plugin
        self.gradient_state = GradientState(
            num_steps=int(ga.num_steps),
            adjust_scheduler=ga.adjust_scheduler,
            sync_with_dataloader=ga.sync_with_dataloader,
            sync_each_batch=ga.sync_each_batch,
        )
        self.log_with = filter_trackers(
            s.log_with, self.project_configuration.logging_dir, warn=self.engine.is_main_process
        )
        self.trackers: list = []
        self._param_remap: dict[int, nn.Parameter] = {}
        self._models: list[nn.Module] = []
        self._optimizers: list[torch.optim.Optimizer] = []  # the raw ones (checkpoints)
        self._prepared_optimizers: list[AcceleratedOptimizer] = []
        self._schedulers: list[Any] = []
        self._dataloaders: list[Any] = []
        self._custom_objects: list[Any] = []
        self._save_model_state_pre_hook: OrderedDict = OrderedDict()
        self._load_model_state_pre_hook: OrderedDict = OrderedDict()
        self.step = 0  # micro-batches seen by ``accumulate``

    def _start_engine(self, s: arguments.Settings) -> None:
        """The engine on the resolved layout (every process by default: Accelerate's replicas) and
        the mesh the parallelism configs point to."""
        if s.fsdp_plugin is not None and s.fsdp_plugin.cpu_ram_efficient_loading:
            # transformers' switch for "load the weights on rank 0 only" (Accelerate sets it too)
            os.environ["ACCELERATE_USE_FSDP"] = os.environ["FSDP_CPU_RAM_EFFICIENT_LOADING"] = "true"
        pc = s.parallelism_config or ParallelismConfig()
        if s.parallelism_config is None and pc.active_dims == ():
            pc = ParallelismConfig(dp_replicate_size=-1)  # Accelerate: replicas over every process
        options = StrategyOptions(
            fsdp=s.fsdp_options,
            activation=s.activation_options,
            tp=s.tp_options,
            cp=s.cp_options,
            loss=s.loss_options,
            compile=s.compile_options,
            float8=s.float8_options,
            qat=s.qat_options,
            param_dtype=s.param_dtype,
        )
        self.engine = Engine(pc, options, device=s.device, timeout_s=s.timeout_s)
        self.parallelism_config = pc.resolve(self.engine.world_size)
        self.torch_device_mesh = self.engine.mesh
        self.parallelism_config.device_mesh = self.torch_device_mesh
        if s.parallelism_config is not None:
            s.parallelism_config.device_mesh = self.torch_device_mesh

    def _take_settings(self, s: arguments.Settings) -> None:
        """The resolved plugins and handlers as attributes (Accelerate's names)."""
        self.fsdp_plugin, self.dynamo_plugin = s.fsdp_plugin, s.dynamo_plugin
        self.dataloader_config, self.project_configuration = s.dataloader_config, s.project_configuration
        self.device_placement = s.device_placement
        self.step_scheduler_with_optimizer = s.step_scheduler_with_optimizer
        self.rng_types = s.rng_types
        self.ddp_handler = s.handlers.get("ddp_handler")
        self.init_handler = s.handlers.get("init_handler")
        self.autocast_handler = s.handlers.get("autocast_handler")
        self.profile_handler = s.handlers.get("profile_handler")
        self.scaler_handler, self.native_amp = s.handlers.get("scaler_handler"), s.param_dtype is not None
        self.scaler = None  # fp16 compute (mixed_precision or the FSDP plugin's policy): loss scaling
        if s.param_dtype == torch.float16:
            self.scaler = (self.scaler_handler or GradScalerKwargs()).build()

    # ------------------------------------------------------------ what runs
    @property
    def device(self) -> torch.device:
        return self.engine.device

    # the engine's strategy options, under the Accelerator's argument names
    fsdp_options = property(lambda self: self.engine.options.fsdp)
    activation_options = property(lambda self: self.engine.options.activation)
    tp_options = property(lambda self: self.engine.options.tp)
    cp_options = property(lambda self: self.engine.options.cp)
    loss_options = property(lambda self: self.engine.options.loss)
    compile_options = property(lambda self: self.engine.options.compile)
    float8_options = property(lambda self: self.engine.options.float8)
    qat_options = property(lambda self: self.engine.options.qat)

    @property
    def mixed_precision(self) -> str:
        return self._settings.mixed_precision

    @property
    def param_dtype(self) -> torch.dtype | None:
        """The compute dtype of prepared models (None: fp32)."""
        return self._settings.param_dtype

    @property
    def distributed_type(self) -> DistributedType:
        if self.engine.world_size == 1:
            return DistributedType.NO
        if self.parallelism_config.fsdp_enabled:
            return DistributedType.FSDP
        return DistributedType.MULTI_CPU if self.engine.device.type == "cpu" else DistributedType.MULTI_GPU

    @property
    def is_fsdp2(self) -> bool:
        return self.distributed_type == DistributedType.FSDP

    @property
    def is_composable_parallelism_enabled(self) -> bool:
        return self.is_fsdp2

    @property
    def state(self) -> AcceleratorState:
        return AcceleratorState(
            distributed_type=self.distributed_type,
            num_processes=self.num_processes,
            process_index=self.process_index,
            local_process_index=self.local_process_index,
            device=self.device,
            mixed_precision=self.mixed_precision,
            parallelism_config=self.parallelism_config,
            device_mesh=self.torch_device_mesh,
            fsdp_plugin=self.fsdp_plugin,
            dynamo_plugin=self.dynamo_plugin,
        )

    @property
    def deepspeed_plugin(self) -> None:
        return None

    @property
    def fp8_backend(self) -> str:
        return "NO"

    # dataloader configuration, under Accelerate's attribute names
    split_batches = property(lambda self: self.dataloader_config.split_batches)
    dispatch_batches = property(lambda self: self.dataloader_config.dispatch_batches)
    use_seedable_sampler = property(lambda self: self.dataloader_config.use_seedable_sampler)
    non_blocking = property(lambda self: self.dataloader_config.non_blocking)
    use_stateful_dataloader = property(lambda self: self.dataloader_config.use_stateful_dataloader)

    @property
    def even_batches(self) -> bool:
        return self.dataloader_config.even_batches

    @even_batches.setter
    def even_batches(self, value: bool) -> None:
        if not value:
            raise ValueError("even_batches=False is not supported: prepared loaders are always even")

    # ---------------------------------------------------------------- mesh
    def mesh(self, *dims: str):
        """Sub-mesh for base or flattened dim names, e.g. ``acc.mesh("dp_shard_cp")``."""
        return self.engine.submesh(*dims)

    def rank_in(self, dim: str) -> int:
        """This rank's index along a mesh dim (``dp``, ``tp``, ``cp``, ``dp_shard_cp``...)."""
        return self.engine.rank_in(dim)

    dp_rank = property(lambda self: self.engine.dp_rank)
    dp_size = property(lambda self: self.engine.dp_size)
    tensor_parallel_rank = property(lambda self: self.rank_in("tp"))
    context_parallel_rank = property(lambda self: self.rank_in("cp"))
    data_parallel_rank = property(lambda self: self.rank_in("dp_replicate"))
    data_parallel_shard_rank = property(lambda self: self.rank_in("dp_shard"))

    @property
    def pipeline_parallel_rank(self) -> int:
        """This rank's pipeline stage index (``pp_size``: ndparallel's own, Accelerate has no PP)."""
        return self.rank_in("pp")

    # -------------------------------------------------------------- prepare
    def prepare(self, *objects: Any, device_placement=None) -> Any:
        """Parallelise models, wrap optimizers (remapped onto the new parameters) and schedulers so
        they follow gradient accumulation, shard ``DataLoader``s over the dp ranks. Returns the
        objects in the order given (one object: itself)."""

        out = prepare_all(self, list(objects), device_placement)
        return out[0] if len(out) == 1 else tuple(out)

    def prepare_model(
        self,
        model: nn.Module,
        device_placement: bool | None = None,
        evaluation_mode: bool = False,
        adapter: Any = None,
        quantization: Any = None,
    ) -> nn.Module:
        """Apply the layout's strategies (``parallel/parallelize.py`` says in which order). A model this
        Accelerator already prepared (e.g. from ``load_model``) is returned as is. ``adapter`` (a peft
        ``LoraConfig``) wraps the model with LoRA first and returns the ``PeftModel``; a ``PeftModel`` passed
        in is parallelised as is (docs/lora.md). ``quantization`` (``NF4Config()`` / ``"nf4"`` / a 4-bit
        ``BitsAndBytesConfig``) stores the frozen base linears as torchao NF4 first (QLoRA: docs/lora.md)."""

        if device_placement is False:
            raise ValueError(
                "prepare_model(device_placement=False) is not supported: sharded models live "
                "on the Accelerator's device (device placement of batches: prepare_data_loader)"
            )
        if evaluation_mode:
            raise ValueError(
                "prepare_model(evaluation_mode=True) is not supported: prepare the model as for "
                "training (sharded) and call model.eval() / torch.no_grad() for inference"
            )
        return prepare_model(self, model, adapter, quantization)

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer, device_placement=None):

        return prepare_optimizer(self, optimizer)

    def prepare_scheduler(self, scheduler):

        return prepare_scheduler(self, scheduler)

    def prepare_data_loader(self, data_loader, device_placement=None, slice_fn_for_dispatch=None):

        if slice_fn_for_dispatch is not None:
            raise ValueError("slice_fn_for_dispatch belongs to dispatch_batches, which is not supported")
        return prepare_data_loader(self, data_loader, device_placement)

    def skip_first_batches(self, dataloader, num_batches: int = 0):
        """The prepared ``dataloader`` starting ``num_batches`` batches later (resuming mid-epoch)."""
        if not isinstance(dataloader, PreparedDataLoader):
            raise ValueError("skip_first_batches takes a loader returned by accelerator.prepare")
        return PreparedDataLoader(
            dataloader.loader,
            self.gradient_state,
            dataloader.rng_types,
            skip_batches=dataloader.skip_batches + num_batches,
            total_samples=dataloader.total_samples,
            global_batch=dataloader.global_batch,
        )

    def verify_device_map(self, model: nn.Module) -> bool:
        """True if the model was loaded with a multi-device ``device_map`` (big-model inference),
        which cannot be trained in a distributed layout."""
        return any(len(set(getattr(m, "hf_device_map", {}).values())) > 1 for m in model.modules())

    def deepspeed_ulysses_dl_adapter(self, dl, model):
        raise NotImplementedError(
            "DeepSpeed Ulysses is not supported: use ParallelismConfig(cp_size=...) "
            "with maybe_context_parallel"
        )

    # ------------------------------------------------------- models on disk
    def load_model(self, path_or_config, **kwargs) -> nn.Module:
        """Build the model on the meta device, parallelise it, then read only this rank's shards
        from the safetensors files (DCP resharding). ``path_or_config``: an HF model dir, an HF
        config, or a built-in preset name (random init, same on every rank). ``adapter=LoraConfig``
        returns a LoRA ``PeftModel`` over the frozen, sharded base; ``quantization=NF4Config()``
        (or ``"nf4"``, a 4-bit ``BitsAndBytesConfig``) makes that base 4-bit NF4 (QLoRA). Keyword
        arguments: ``ndparallel.engine.model_build.build_model``'s."""

        return register_model(self, self.engine.build_model(path_or_config, **kwargs))
