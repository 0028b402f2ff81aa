"""The planner's ``Settings``: everything of a run besides its layout that changes the memory or the
time of one step, one field per option in the estimates' own vocabulary. Each field a flag sets
declares its ``ndparallel plan`` flag (``plan/field_marks.py``: ``flag``; the adapter's fields
``adapter``); ``from_options`` derives the settings of the runtime's options and
``train_config_options`` writes them back as a training config's keys: the one place outside
``config/`` where the planner's names meet the run's."""

from __future__ import annotations

from dataclasses import dataclass, field

from ndparallel.layout.dims import ParallelDims
from ndparallel.parallel.options import StrategyOptions
from ndparallel.plan.field_marks import ADAPTERS, COMMS, LONG_CONTEXT, STEP, adapter, flag
from ndparallel.plan.memory.qat_memory import qat_format
from ndparallel.plan.pipeline.schedule_model import canonical, default_virtual

OPTIMIZER_STATE_BYTES = {
    "adamw": 8.0,
    "sgd": 0.0,
    "adamw_8bit": 2 + 8 / 256,
    "adamw_4bit": 1 + 8 / 128,
    "muon": 4.0,
}
"""Bytes of optimizer state per parameter, per optimizer (``Settings.optimizer_state_bytes``)."""


@dataclass(frozen=True)
class Settings:
    """Everything besides the layout that changes memory or time of one training step."""

    seq_len: int = field(metadata=flag("sequence length (default 4096)", positive=True))
    micro_batch: int = 1
    grad_accum: int = field(default=1, metadata=STEP)
    checkpointing: bool = False
    """Activation checkpointing of every decoder layer (policy: ``ac_policy``)."""
    ac_policy: str = field(
        default="full",
        metadata=flag(
            "checkpointing policy (fsdp_config.ac_policy): full recomputes each layer; selective only the "
            "norms and the MLP activation (Megatron's scheme); op: torchtitan's per-op policy (for "
            "comparisons; not run by ndparallel)",
            choices=("full", "selective", "op"),
        ),
    )
    """'full': keep each layer's input, recompute the layer. 'selective': the runtime's
    ``fsdp_config.ac_policy: selective`` (``techniques/selective_ac.py``, Megatron's scheme):
    recompute the norms and the MLP activation only
    (``plan/memory/activations.py::selective_saved_per_token``).
    'op': torchtitan's per-op policy (``selective_ac_option = 'op'``), modelled for comparisons
    with its published rows; ndparallel does not run it."""
    mixed_precision: str = field(
        default="bf16",
        metadata=flag(choices=("bf16", "fp16", "fp32")),
    )
    """'bf16': fp32 master params, bf16 compute/all-gather, fp32 gradient reduction; 'fp16': the same
    bytes and FLOP/s in fp16 (loss scaling adds no memory: one scalar); 'fp32'."""
    optimizer: str = field(
        default="adamw",
        metadata=STEP
        | flag(
            "adamw_8bit / adamw_4bit: torchao's low-bit AdamW (train's adamw_8bit, paged_adamw_8bit, "
            "adamw_torch_4bit ...); muon: Muon + AdamW (plan/muon_cost.py)",
            choices=tuple(OPTIMIZER_STATE_BYTES),
        ),
    )
    sequence_parallel: bool = field(
        default=True,
        metadata=flag("TP with all-reduce instead of sequence parallel", group=COMMS),
    )
    """TP with sequence parallel (all-gather + reduce-scatter) instead of all-reduce."""
    sp_saved_shards: bool = True
    """Under sequence parallel, each block's gathered input is saved as the rank's sequence shard
    and gathered again in backward (the runtime's ``TPOptions.sequence_parallel_saved_shards``;
    ``plan/memory/sp_activations.py``); False: the gathered input is saved whole."""
    loss_parallel: bool = field(
        default=True,
        metadata=flag("TP gathers full logits instead of a vocab-parallel loss", group=COMMS),
    )
    """Cross-entropy on vocab-sharded logits (else the LM head gathers full logits on every rank)."""
    unsharded_grad_accumulation: bool = field(default=False, metadata=STEP)
    """ndparallel's ``FSDPOptions.unsharded_grad_accumulation``: during gradient accumulation skip the
    reduce-scatter too, keeping unsharded fp32 gradients until the last micro-batch. Default (the
    runtime's default): reduce-scatter every micro-batch, gradients stay sharded; the replica
    all-reduce (DP/HSDP) runs once, after the last micro-batch."""
    reshard_after_forward: bool = field(
        default=True,
        metadata=flag("FSDP keeps params unsharded between forward and backward", group=COMMS),
    )
    cp_strategy: str = field(
        default="ring",
        metadata=flag(
            "context-parallel attention communication (train's cp_comm_strategy); --max-seq-len tries "
            "each unless this is given",
            choices=("ring", "allgather", "ulysses"),
            given=True,
            group=COMMS,
        ),
    )
    """CP attention: 'ring' (K/V hop rank to rank), 'allgather' (K/V gathered once per layer) or
    'ulysses' (Ulysses: heads <-> sequence all-to-all; cp bounded by the head counts)."""
    prefetch: int = 1
    """FSDP units all-gathered ahead of the one computing."""
    loss_impl: str = field(
        default="full",
        metadata=flag(
            "chunked: the trainer's memory-efficient loss (default); full: whole logits",
            choices=("full", "chunked"),
        ),
    )
    """'full': ``causal_lm_loss`` on the whole micro-batch's logits; 'chunked': the runtime's
    memory-efficient loss (``techniques/chunked_ce.py``; what ``ndparallel train`` runs for the
    Llama/Qwen/Mistral families: ``ndparallel plan`` and ``PlanRequest`` default to it), holding one
    chunk's logits. The dataclass default stays 'full' for the hand-checked formulas in tests."""
    loss_chunk_tokens: int | None = field(
        default=None,
        metadata=flag(
            "tokens per chunk of --loss-impl chunked (default: 256 MiB of fp32 logits)", positive=True
        ),
    )
    """Tokens per chunk of the chunked loss; None: the runtime's rule (256 MiB of fp32 logits)."""
    optimizer_fused: bool = field(
        default=False,
        metadata=STEP
        | flag("AdamW fused=True (default: torch's foreach AdamW, as the trainer)", name="fused-adamw"),
    )
    """AdamW ``fused=True`` (else torch's default foreach implementation, the trainer's)."""
    set_to_none: bool = field(default=True, metadata=STEP)
    """``zero_grad(set_to_none=True)`` (torch's default, the trainer's): no gradient exists from
    the optimizer step until each FSDP unit's backward produces it. False keeps them allocated."""
    cp_kernel: str = field(
        default="flash",
        metadata=flag(
            "CP block kernel (flash: what 'auto' runs on CUDA in bf16; math: fp32)",
            choices=("flash", "math"),
            group=COMMS,
        ),
    )
    """CP block kernel: 'flash' (torch's flash op; what 'auto' runs on CUDA bf16/fp16) or 'math'."""
    lora_r: int = field(
        default=0, metadata=adapter("LoRA rank (default 16; needs --adapter lora or qlora)", type=int)
    )
    """LoRA rank on every linear of the decoder layers (``plan --adapter lora``); 0: full
    fine-tuning. See ``ndparallel.plan.adapters.lora_cost``."""
    lora_saved: tuple[str, ...] = field(default=(), metadata=adapter())
    """Tables trained in full beside the adapters (``lora_modules_to_save``): 'embed', 'head'
    (``plan --lora-modules-to-save``; ``ndparallel.plan.adapters.lora_cost``)."""
    quantized_base: bool = field(default=False, metadata=adapter())
    """QLoRA (``plan --adapter qlora``): the decoder linears of the frozen base are 4-bit NF4
    (``ndparallel.plan.adapters.qlora``); needs ``lora_r``."""
    qat: str | None = field(
        default=None,
        metadata=flag(
            "quantisation-aware training (train's qat:): int4, int4/int8, int4/float8, float8/float8 or "
            "mxfp4/mxfp4; adds what the fake quantisers keep for backward",
            metavar="WEIGHT[/ACT]",
            group=ADAPTERS,
        ),
    )
    """QAT's weight[/activation] formats (``plan --qat``; ``plan/memory/qat_memory.py``); None: off."""
    tiled_mlp: bool = field(
        default=False,
        metadata=flag("sequence-tiled MLP (train's tiled_mlp: true)", group=LONG_CONTEXT),
    )
    """Sequence-tiled MLP (``tiled_mlp``): see ``ndparallel.plan.memory.long_context``."""
    tiled_mlp_num_shards: int | None = field(
        default=None,
        metadata=flag(
            "tiles per MLP call (default: ceil(local tokens / hidden))",
            positive=True,
            needs="tiled_mlp",
            group=LONG_CONTEXT,
        ),
    )
    """Tiles per MLP call; None: the runtime's rule, ceil(local tokens / hidden)."""
    activation_offloading: bool = field(
        default=False,
        metadata=flag(
            "what checkpointing keeps in host memory: full, the layer inputs; selective, its saved tensors "
            "but down_proj's output (train's activation_offloading: true; turns checkpointing on)",
            refuses=("activation_checkpointing", "off", "offloads what checkpointing keeps"),
            group=LONG_CONTEXT,
        ),
    )
    """Checkpointed layer inputs kept in host memory (needs ``checkpointing``)."""
    offload_in_flight: int = 2
    """Layer inputs of the offloader on the device at once (its ``max_in_flight`` copies in the
    forward; the restored one and the prefetched one in backward)."""
    pp_schedule: str = field(default="1F1B", metadata=STEP)
    """Pipeline schedule (torch's names, train's ``pipeline_schedule``); used when pp > 1."""
    pp_virtual: int = field(default=1, metadata=STEP)
    """Stages per pp rank (train's ``pipeline_virtual_stages``): 2+ for the interleaved and
    zero-bubble schedules."""
    sync_every_microbatch: bool = field(default=False, metadata=STEP)
    """Gradients reduced after every micro-batch's backward, the replica all-reduce included: what
    the pipeline runtime does by default (torch's ``PipelineStage`` never skips the gradient sync of
    a stage that is not itself an FSDP module; ``plan/pipeline/pipeline_estimate.py``)."""
    reshard_after_backward: bool = field(default=True, metadata=STEP)
    """FSDP reshards a unit's parameters after its backward (torch's default). False under pipeline
    parallel with ``unsharded_grad_accumulation``: the stage is torch's FSDP root and its
    ``PipelineStage`` keeps the parameters gathered (``set_reshard_after_backward(False)``) and the
    gradients unsharded until the step's last backward, then reduces once (``perform_reduce_grad``)."""
    pp_in_flight: float = field(default=1.0, metadata=STEP)
    """Micro-batches whose activations a rank holds at its peak, in units of one micro-batch
    through all of its layers: 1 without pipeline parallel; set per pp rank by
    ``plan/pipeline/pipeline_estimate.py`` (``pipeline.in_flight``)."""

    @property
    def recompute(self) -> str:
        """What backward recomputes: 'none' without checkpointing, else the policy ('full',
        'selective', 'op')."""
        return self.ac_policy if self.checkpointing else "none"

    def but(self, **changes) -> Settings:
        """``dataclasses.replace(self, **changes)`` at a tenth of its cost (the search makes tens of
        thousands): ``Settings`` has no ``__post_init__`` to run, so a copy of the fields is the same
        object ``replace`` builds. An unknown name is refused as ``replace`` refuses it."""
        new = object.__new__(Settings)
        fields_ = new.__dict__
        fields_.update(self.__dict__)
        fields_.update(changes)
        if len(fields_) != len(self.__dict__):  # a name that is no field added one
            raise TypeError(f"Settings has no field(s) {sorted(changes.keys() - self.__dict__.keys())}")
        return new

    @classmethod
    def from_options(cls, options: StrategyOptions, seq_len: int, **rest) -> Settings:
        """The settings of a run with the runtime's ``options`` (a ``TrainConfig``'s
        ``strategy_options()``, or an engine's): every field the options decide, derived here once;
        ``rest`` gives the others (batch, optimizer, adapter) and what the run resolves per model
        (``loss_parallel`` / ``loss_impl`` where the options say None: on, chunked)."""
        fsdp, qat, pipe = options.fsdp, options.qat, options.pipeline
        schedule = canonical(pipe.schedule)
        derived = {
            "seq_len": seq_len,
            "checkpointing": fsdp.activation_checkpointing,
            "ac_policy": fsdp.ac_policy,
            "mixed_precision": {"torch.bfloat16": "bf16", "torch.float16": "fp16"}.get(
                str(options.param_dtype), "fp32"
            ),
            "sequence_parallel": options.tp.sequence_parallel,
            "loss_parallel": options.tp.loss_parallel is not False,
            "unsharded_grad_accumulation": fsdp.unsharded_grad_accumulation,
            "reshard_after_forward": fsdp.reshard_after_forward,
            "cp_strategy": options.cp.comm_strategy,
            "loss_impl": "full" if options.loss.chunked is False else "chunked",
            "loss_chunk_tokens": options.loss.chunk_tokens,
            "tiled_mlp": fsdp.tiled_mlp,
            "tiled_mlp_num_shards": fsdp.tiled_mlp_num_shards,
            "activation_offloading": fsdp.activation_offloading,
            "qat": qat_format(qat.weight_dtype, qat.activation_dtype) if qat.enabled else None,
            "pp_schedule": schedule,
            "pp_virtual": pipe.virtual_stages or default_virtual(schedule),
        }
        return cls(**{**derived, **rest})

    def config_keys(self, layout: ParallelDims) -> dict[str, dict]:
        """These settings as a training config's keys (``TrainConfig``'s names, the inverse of
        ``from_options``) under ``layout``, by the part of the config they belong to
        (``plan/cli/report.py``'s ``train_config`` places each part); what the layout or a default
        leaves out is absent."""
        tp = {"sequence_parallel": self.sequence_parallel, "loss_parallel": self.loss_parallel}
        policy = {"ac_policy": "selective"} if self.recompute == "selective" else {}
        pipeline = {"pipeline_schedule": self.pp_schedule}
        if self.pp_virtual != default_virtual(self.pp_schedule):
            pipeline["pipeline_virtual_stages"] = self.pp_virtual
        long_context = {"tiled_mlp": True} if self.tiled_mlp else {}
        if self.tiled_mlp and self.tiled_mlp_num_shards:
            long_context["tiled_mlp_num_shards"] = self.tiled_mlp_num_shards
        if self.activation_offloading:
            long_context["activation_offloading"] = True
        return {
            "fsdp_config": {
                "reshard_after_forward": self.reshard_after_forward,
                "activation_checkpointing": self.checkpointing,
                "unsharded_grad_accumulation": self.unsharded_grad_accumulation,
                **policy,
            },
            "pipeline": pipeline if layout.pp_enabled else {},
            "context_parallel": {"cp_comm_strategy": self.cp_strategy} if layout.cp > 1 else {},
            "tensor_parallel": tp if layout.tp > 1 else {},
            "adapter": {"lora_r": self.lora_r, "lora_alpha": 2 * self.lora_r} if self.lora_r else {},
            "long_context": long_context,
        }

    @property
    def act_bytes(self) -> int:
        return 2 if self.mixed_precision in ("bf16", "fp16") else 4

    @property
    def reducing_microbatches(self) -> int:
        """Micro-batches per step whose backward reduce-scatters gradients."""
        return 1 if self.unsharded_grad_accumulation and not self.sync_every_microbatch else self.grad_accum

    @property
    def replica_reductions(self) -> int:
        """Replica (dp_replicate) all-reduces per step and unit: after the last micro-batch only,
        or after every one (``sync_every_microbatch``)."""
        return self.grad_accum if self.sync_every_microbatch else 1

    def gathers_per_step(self, reshards: bool = True) -> int:
        """All-gathers of one FSDP unit per step (``reshards``: the unit reshards after forward when
        ``reshard_after_forward``). Kept gathered between micro-batches (``reshard_after_backward``
        False): once, or with resharding after forward ``ga + 1``: each forward reshards, and a
        unit's op that follows a forward gathers again (every op but the step's last backward)."""
        again = reshards and self.reshard_after_forward
        if not self.reshard_after_backward:
            return self.grad_accum + 1 if again else 1
        return self.grad_accum * (2 if again else 1)

    @property
    def accumulates_unsharded(self) -> bool:
        """Unsharded fp32 gradients are kept between micro-batches (no sync until the last)."""
        return self.grad_accum > 1 and self.unsharded_grad_accumulation and not self.sync_every_microbatch

    @property
    def param_compute_bytes(self) -> int:
        return self.act_bytes

    @property
    def reduce_bytes(self) -> int:
        return 4

    @property
    def optimizer_state_bytes(self) -> float:
        """Bytes of optimizer state per parameter: AdamW exp_avg + exp_avg_sq in fp32; SGD with
        torch's default momentum=0 keeps none; torchao's 8-bit AdamW int8 codes + one fp32 scale per
        256 values for each moment, its 4-bit one packed codes + one scale per 128 (tensors of
        >= 4096 values, every matrix of a real model); Muon one momentum buffer (its hidden matrices;
        AdamW's second moment on the embedding units is added in ``plan/muon_cost.py``)."""
        return OPTIMIZER_STATE_BYTES[self.optimizer]


COLLECTIVE_FIELDS = {
    "data_parallel": (
        "grad_accum",
        "mixed_precision",
        "unsharded_grad_accumulation",
        "sync_every_microbatch",
        "reshard_after_forward",
        "reshard_after_backward",
    ),
    "tensor_parallel": (
        "mixed_precision",
        "sequence_parallel",
        "sp_saved_shards",
        "loss_parallel",
        "recompute",
    ),
    "context_parallel": ("mixed_precision", "recompute", "cp_strategy"),
}
"""The ``Settings`` fields (``recompute``: the property) each group of a rank's collectives reads:
``plan/time/comms.py`` memoises the groups on them (``tests/test_plan_memo.py`` checks no other
moves them)."""
