"""The planner's ``Settings``: everything of a run besides its layout that changes the memory or the
time of one step, one field per option, named as the training config's key (``NAMED_OTHERWISE``
lists the few that are not, and why). ``from_options`` derives them from the runtime's options and
``yaml_keys`` writes them back as a training config's keys: the one place outside ``config/``
where the planner's settings meet the run's."""

from __future__ import annotations

from dataclasses import dataclass

from ndparallel.layout.dims import ParallelDims
from ndparallel.optim.names import TORCHAO
from ndparallel.parallel.options import StrategyOptions
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


def plan_optimizer(name: str) -> tuple[str, bool]:
    """(the planner's optimizer, fused AdamW) of a training config's ``optimizer:`` name (or of the
    planner's own): torchao's low-bit AdamWs by their state size, ``adamw_torch_fused`` as AdamW with
    the fused kernel, the other AdamWs as AdamW."""
    if name in OPTIMIZER_STATE_BYTES:
        return name, False
    low_bit = {"AdamW8bit": "adamw_8bit", "AdamWFp8": "adamw_8bit", "AdamW4bit": "adamw_4bit"}
    return low_bit.get(TORCHAO.get(name, ""), "adamw"), name == "adamw_torch_fused"


def yaml_optimizer(optimizer: str, fused: bool) -> str:
    """The training config's ``optimizer:`` name of the planner's ``optimizer`` (``plan_optimizer``
    inverted; torchao's fp8 AdamW is written as its 8-bit one, which has the same state size)."""
    if optimizer == "adamw":
        return "adamw_torch_fused" if fused else "adamw_torch"
    return {"adamw_4bit": "adamw_torch_4bit"}.get(optimizer, optimizer)


@dataclass(frozen=True)
class Settings:
    """Everything besides the layout that changes memory or time of one training step."""

    sequence_len: int
    micro_batch_size: int = 1
    gradient_accumulation_steps: int = 1
    activation_checkpointing: bool = False
    """Activation checkpointing of every decoder layer (policy: ``ac_policy``)."""
    ac_policy: str = "full"
    """'full': keep each layer's input, recompute the layer. 'selective': the runtime's
    ``fsdp_config.ac_policy: selective`` (``techniques/selective_ac.py``, Megatron's scheme):
    recompute the norms and the MLP activation only
    (``plan/memory/activations.py::selective_saved_per_token``).
    'op': torchtitan's per-op policy (``selective_ac_option = 'op'``), modelled for comparisons
    with its published rows; ndparallel does not run it."""
    mixed_precision: str = "bf16"
    """'bf16': fp32 master params, bf16 compute/all-gather, fp32 gradient reduction; 'fp16': the same
    bytes and FLOP/s in fp16 (loss scaling adds no memory: one scalar); 'fp32'."""
    optimizer: str = "adamw"
    """By its state per parameter (``OPTIMIZER_STATE_BYTES``): adamw, sgd, adamw_8bit and adamw_4bit
    (torchao's low-bit AdamWs), muon (Muon + AdamW, ``plan/muon_cost.py``); a training config's
    names map to these (``plan_optimizer``)."""
    sequence_parallel: bool = True
    """TP with sequence parallel (all-gather + reduce-scatter) instead of all-reduce."""
    sequence_parallel_saved_shards: bool = True
    """Under sequence parallel, each block's gathered input is saved as the rank's sequence shard
    and gathered again in backward (the runtime's ``TPOptions.sequence_parallel_saved_shards``;
    ``plan/memory/sp_activations.py``); False: the gathered input is saved whole."""
    loss_parallel: bool = True
    """Cross-entropy on vocab-sharded logits (else the LM head gathers full logits on every rank)."""
    unsharded_grad_accumulation: bool = False
    """ndparallel's ``FSDPOptions.unsharded_grad_accumulation``: during gradient accumulation skip the
    reduce-scatter too, keeping unsharded fp32 gradients until the last micro-batch. Default (the
    runtime's default): reduce-scatter every micro-batch, gradients stay sharded; the replica
    all-reduce (DP/HSDP) runs once, after the last micro-batch."""
    reshard_after_forward: bool = True
    cp_comm_strategy: str = "ring"
    """CP attention: 'ring' (K/V hop rank to rank), 'allgather' (K/V gathered once per layer) or
    'ulysses' (Ulysses: heads <-> sequence all-to-all; cp bounded by the head counts)."""
    prefetch: int = 1
    """FSDP units all-gathered ahead of the one computing."""
    chunked_loss: bool = False
    """The runtime's memory-efficient loss (``techniques/chunked_ce.py``; what ``ndparallel train``
    runs for the Llama/Qwen/Mistral families: ``ndparallel plan`` and ``PlanRequest`` default to it),
    holding one chunk's logits; False: ``causal_lm_loss`` on the whole micro-batch's logits. The
    dataclass default stays False for the hand-checked formulas in tests."""
    loss_chunk_tokens: int | None = None
    """Tokens per chunk of the chunked loss; None: the runtime's rule (256 MiB of fp32 logits)."""
    optimizer_fused: bool = False
    """AdamW ``fused=True`` (else torch's default foreach implementation, the trainer's)."""
    set_to_none: bool = True
    """``zero_grad(set_to_none=True)`` (torch's default, the trainer's): no gradient exists from
    the optimizer step until each FSDP unit's backward produces it. False keeps them allocated."""
    cp_kernel: str = "flash"
    """CP block kernel: 'flash' (torch's flash op; what 'auto' runs on CUDA bf16/fp16) or 'math'."""
    lora_r: int = 0
    """LoRA rank on every linear of the decoder layers (``plan --adapter lora``); 0: full
    fine-tuning. See ``plan/adapters/lora_cost.py``."""
    lora_saved: tuple[str, ...] = ()
    """Tables trained in full beside the adapters (``lora_modules_to_save``): 'embed', 'head'
    (``plan/adapters/lora_cost.py``)."""
    load_in_4bit: bool = False
    """QLoRA (``plan --adapter qlora``): the decoder linears of the frozen base are 4-bit NF4
    (``plan/adapters/qlora.py``); needs ``lora_r``."""
    qat: str | None = None
    """QAT's weight[/activation] formats (``plan --qat``; ``plan/memory/qat_memory.py``); None: off."""
    tiled_mlp: bool = False
    """Sequence-tiled MLP (``tiled_mlp``): see ``plan/memory/long_context.py``."""
    tiled_mlp_num_shards: int | None = None
    """Tiles per MLP call; None: the runtime's rule, ceil(local tokens / hidden)."""
    activation_offloading: bool = False
    """Checkpointed layer inputs kept in host memory (needs ``activation_checkpointing``)."""
    offload_in_flight: int = 2
    """Layer inputs of the offloader on the device at once (its ``max_in_flight`` copies in the
    forward; the restored one and the prefetched one in backward)."""
    pipeline_schedule: str = "1F1B"
    """Pipeline schedule (torch's names); used when pp > 1."""
    pipeline_virtual_stages: int = 1
    """Stages per pp rank: 2+ for the interleaved and zero-bubble schedules."""
    sync_every_microbatch: bool = False
    """Gradients reduced after every micro-batch's backward, the replica all-reduce included: what
    the pipeline runtime does by default (torch's ``PipelineStage`` never skips the gradient sync of
    a stage that is not itself an FSDP module; ``plan/pipeline/pipeline_estimate.py``)."""
    reshard_after_backward: bool = True
    """FSDP reshards a unit's parameters after its backward (torch's default). False under pipeline
    parallel with ``unsharded_grad_accumulation``: the stage is torch's FSDP root and its
    ``PipelineStage`` keeps the parameters gathered (``set_reshard_after_backward(False)``) and the
    gradients unsharded until the step's last backward, then reduces once (``perform_reduce_grad``)."""
    pp_in_flight: float = 1.0
    """Micro-batches whose activations a rank holds at its peak, in units of one micro-batch
    through all of its layers: 1 without pipeline parallel; set per pp rank by
    ``plan/pipeline/pipeline_estimate.py`` (``schedule_model.in_flight``)."""

    @property
    def recompute(self) -> str:
        """What backward recomputes: 'none' without checkpointing, else the policy ('full',
        'selective', 'op')."""
        return self.ac_policy if self.activation_checkpointing else "none"

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
    def from_options(cls, options: StrategyOptions, sequence_len: int, **rest) -> Settings:
        """The settings of a run with the runtime's ``options`` (a ``TrainConfig``'s
        ``strategy_options()``, or an engine's): every field the options decide, derived here once;
        ``rest`` gives the others (batch, optimizer, adapter) and what the run resolves per model
        (``loss_parallel`` / ``chunked_loss`` where the options say None: on)."""
        fsdp, act, qat, pipe = options.fsdp, options.activation, options.qat, options.pipeline
        schedule = canonical(pipe.schedule)
        derived = {
            "sequence_len": sequence_len,
            "activation_checkpointing": act.activation_checkpointing,
            "ac_policy": act.ac_policy,
            "mixed_precision": {"torch.bfloat16": "bf16", "torch.float16": "fp16"}.get(
                str(options.param_dtype), "fp32"
            ),
            "sequence_parallel": options.tp.sequence_parallel,
            "sequence_parallel_saved_shards": options.tp.sequence_parallel_saved_shards,
            "loss_parallel": options.tp.loss_parallel is not False,
            "unsharded_grad_accumulation": fsdp.unsharded_grad_accumulation,
            "reshard_after_forward": fsdp.reshard_after_forward,
            "cp_comm_strategy": options.cp.comm_strategy,
            "chunked_loss": options.loss.chunked is not False,
            "loss_chunk_tokens": options.loss.chunk_tokens,
            "tiled_mlp": act.tiled_mlp,
            "tiled_mlp_num_shards": act.tiled_mlp_num_shards,
            "activation_offloading": act.activation_offloading,
            "qat": qat_format(qat.weight_dtype, qat.activation_dtype) if qat.enabled else None,
            "pipeline_schedule": schedule,
            "pipeline_virtual_stages": pipe.virtual_stages or default_virtual(schedule),
        }
        return cls(**{**derived, **rest})

    def yaml_keys(self, layout: ParallelDims) -> dict:
        """These settings as a training config's keys (``TrainConfig``'s names: the inverse of
        ``from_options`` and ``plan_optimizer``) under ``layout``, in the order ``plan
        --write-config`` writes them; what the layout or a default leaves out is absent."""
        policy = {"ac_policy": "selective"} if self.recompute == "selective" else {}
        out = {
            "sequence_len": self.sequence_len,
            "micro_batch_size": self.micro_batch_size,
            "gradient_accumulation_steps": self.gradient_accumulation_steps,
            "fsdp_config": {
                "reshard_after_forward": self.reshard_after_forward,
                "activation_checkpointing": self.activation_checkpointing,
                "unsharded_grad_accumulation": self.unsharded_grad_accumulation,
                **policy,
            },
            "optimizer": yaml_optimizer(self.optimizer, self.optimizer_fused),
        }
        if layout.pp_enabled:
            out["pipeline_schedule"] = self.pipeline_schedule
            if self.pipeline_virtual_stages != default_virtual(self.pipeline_schedule):
                out["pipeline_virtual_stages"] = self.pipeline_virtual_stages
        if layout.cp > 1:
            out["cp_comm_strategy"] = self.cp_comm_strategy
        if layout.tp > 1:
            out.update(sequence_parallel=self.sequence_parallel, loss_parallel=self.loss_parallel)
        if not self.chunked_loss and not self.qat:  # else the run's default: on where exact, off under QAT
            out["chunked_loss"] = False
        if self.loss_chunk_tokens:
            out["loss_chunk_tokens"] = self.loss_chunk_tokens
        if self.mixed_precision in ("bf16", "fp16"):
            out[self.mixed_precision] = True
        if self.lora_r:
            out.update(adapter="qlora" if self.load_in_4bit else "lora", lora_r=self.lora_r)
            out.update(lora_alpha=2 * self.lora_r, lora_target_linear=True)
            if self.load_in_4bit:
                out["load_in_4bit"] = True
            if self.lora_saved:
                out["lora_modules_to_save"] = [
                    {"embed": "embed_tokens", "head": "lm_head"}[t] for t in self.lora_saved
                ]
        if self.qat:
            weight, _, act = self.qat.partition("/")
            group = {"group_size": 32} if weight in ("int4", "mxfp4") else {}
            out["qat"] = {"weight_dtype": weight, "activation_dtype": act or None, **group}
        if self.tiled_mlp:
            out["tiled_mlp"] = True
            if self.tiled_mlp_num_shards:
                out["tiled_mlp_num_shards"] = self.tiled_mlp_num_shards
        if self.activation_offloading:
            out["activation_offloading"] = True
        return out

    @property
    def act_bytes(self) -> int:
        return 2 if self.mixed_precision in ("bf16", "fp16") else 4

    @property
    def reducing_microbatches(self) -> int:
        """Micro-batches per step whose backward reduce-scatters gradients."""
        return (
            1
            if self.unsharded_grad_accumulation and not self.sync_every_microbatch
            else self.gradient_accumulation_steps
        )

    @property
    def replica_reductions(self) -> int:
        """Replica (dp_replicate) all-reduces per step and unit: after the last micro-batch only,
        or after every one (``sync_every_microbatch``)."""
        return self.gradient_accumulation_steps if self.sync_every_microbatch else 1

    def gathers_per_step(self, reshards: bool = True) -> int:
        """All-gathers of one FSDP unit per step (``reshards``: the unit reshards after forward when
        ``reshard_after_forward``). Kept gathered between micro-batches (``reshard_after_backward``
        False): once, or with resharding after forward ``ga + 1``: each forward reshards, and a
        unit's op that follows a forward gathers again (every op but the step's last backward)."""
        again = reshards and self.reshard_after_forward
        if not self.reshard_after_backward:
            return self.gradient_accumulation_steps + 1 if again else 1
        return self.gradient_accumulation_steps * (2 if again else 1)

    @property
    def accumulates_unsharded(self) -> bool:
        """Unsharded fp32 gradients are kept between micro-batches (no sync until the last)."""
        return (
            self.gradient_accumulation_steps > 1
            and self.unsharded_grad_accumulation
            and not self.sync_every_microbatch
        )

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
        "gradient_accumulation_steps",
        "mixed_precision",
        "unsharded_grad_accumulation",
        "sync_every_microbatch",
        "reshard_after_forward",
        "reshard_after_backward",
    ),
    "tensor_parallel": (
        "mixed_precision",
        "sequence_parallel",
        "sequence_parallel_saved_shards",
        "loss_parallel",
        "recompute",
    ),
    "context_parallel": ("mixed_precision", "recompute", "cp_comm_strategy"),
}
"""The ``Settings`` fields (``recompute``: the property) each group of a rank's collectives reads:
``plan/time/comms.py`` memoises the groups on them (``tests/test_plan_memo.py`` checks no other
moves them)."""

STEP_FIELDS = (
    "gradient_accumulation_steps",
    "optimizer",
    "unsharded_grad_accumulation",
    "optimizer_fused",
    "set_to_none",
    "pipeline_schedule",
    "pipeline_virtual_stages",
    "sync_every_microbatch",
    "reshard_after_backward",
    "pp_in_flight",
)
"""The settings of the optimizer step or of accumulation, which the cost of one forward and
backward does not read (``plan/time/compute.py`` memoises a micro-batch on the others)."""

NAMED_OTHERWISE = {
    "mixed_precision": ("bf16, fp16", "one of three precisions, where the YAML has two switches"),
    "optimizer_fused": ("optimizer: adamw_torch_fused", "the YAML names the fused kernel as an optimizer"),
    "lora_saved": ("lora_modules_to_save", "the tables those module names select (embed, head)"),
    "sequence_parallel_saved_shards": (None, "the runtime's TPOptions field, on in every run"),
    "prefetch": (None, "FSDP2's own: one unit gathered ahead"),
    "set_to_none": (None, "the trainer's zero_grad(set_to_none=True)"),
    "cp_kernel": (None, "the runtime picks the CP block kernel by device and dtype"),
    "offload_in_flight": (None, "the offloader's copies in flight, fixed by the runtime"),
    "sync_every_microbatch": (None, "derived for each pipeline rank from unsharded_grad_accumulation"),
    "reshard_after_backward": (None, "derived for each pipeline rank from unsharded_grad_accumulation"),
    "pp_in_flight": (None, "derived for each pipeline rank from its schedule"),
}
"""The ``Settings`` fields that are not a training config's key of the same name: field -> (the YAML
key that says the same fact, or None where the run has no key for it; why the name differs). Every
other field is the YAML's key (``tests/test_option_round_trip.py`` reads this table)."""

UNPRICED = {
    "fsdp.cpu_offload": "host-resident parameters, gradients and states: not modelled",
    "fsdp.layer_classes": "the planner shards each decoder layer, as the runtime does by default",
    "fsdp.reduce_dtype": "gradients reduced in fp32, the runtime's only choice from a config",
    "tp.plan": "the model's own tensor-parallel plan",
    "cp.load_balance": "on in every run",
    "compile": "torch.compile: the calibrated kernel rates stand for it",
    "float8": "float8 training: not modelled",
    "qat.group_size": "the fake quantisers' saved bytes do not depend on it",
    "qat.quantize_embedding": "not modelled",
    "qat.fake_quant_after_n_steps": "the peak is that of the quantised steps",
    "pipeline.microbatches": "one pipeline micro-batch per accumulation step, the runtime's default",
    "pipeline.layers_per_stage": "an even split of the layers, the runtime's default",
    "pipeline.split_points": "an even split of the layers, the runtime's default",
}
"""The runtime's options (``StrategyOptions``: record, or record.field) the planner does not price,
and why: every other one reaches ``Settings`` through ``from_options`` and comes back through
``yaml_keys`` (``tests/test_option_round_trip.py``)."""
