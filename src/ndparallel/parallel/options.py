"""Options of each parallel dimension and of each decoder layer's activation memory, as small
dataclasses (documented fields, no logic), and ``StrategyOptions``: one run's options of every
dimension and technique (``techniques/technique_options.py``).

A field is the training config's key less the prefix its record already says: the YAML is flat,
the records are not (``CPOptions.comm_strategy`` is ``cp_comm_strategy``, ``LossOptions.chunked``
``chunked_loss``, ``PipelineOptions.schedule`` ``pipeline_schedule``); ``config/schema.py`` maps
them in one place and ``tests/test_option_round_trip.py`` holds the mapping to the YAML."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:  # the planner imports PipelineOptions: no torch at import time
    import torch

from ndparallel.techniques.technique_options import CompileOptions, Float8Options, LossOptions, QATOptions


@dataclass(frozen=True)
class FSDPOptions:
    """FSDP2's options (``fully_shard``): resharding, host offload, the blocks sharded one by one,
    when gradients are reduced and in which dtype."""

    reshard_after_forward: bool = True
    """Free the gathered parameters after forward (re-gather in backward): less memory, more comm."""
    cpu_offload: bool = False
    """Keep sharded parameters, gradients and optimizer states in host memory."""
    layer_classes: tuple[str, ...] | None = None
    """Class names of the blocks to shard one by one (and to checkpoint, tile and offload:
    ``ActivationOptions``); default: the model's ``_no_split_modules``."""
    unsharded_grad_accumulation: bool | None = None
    """During gradient accumulation, skip the reduce-scatter too and keep *unsharded* gradients
    until the last micro-batch: one gradient reduction per optimizer step (less communication, but
    a full-size gradient of the rank's parameters). ``None`` (default): on under pipeline parallel
    (Meta's and torchtitan's choice: a stage holds 1/pp of the model; ``parallel/pp/schedule.py``),
    off otherwise; ``False``: reduce-scatter every micro-batch so gradients stay sharded (only the
    replica all-reduce waits for the last micro-batch) — the fallback ``ndparallel plan`` picks
    when the unsharded gradients do not fit."""
    reduce_dtype: torch.dtype | None = None
    """dtype of the gradient reduce-scatter / all-reduce; None = fp32 (exact sums under bf16)."""


@dataclass(frozen=True)
class ActivationOptions:
    """What each decoder layer keeps for backward, with or without FSDP (docs/long_context.md):
    activation checkpointing and its policy, offloading what it keeps, the sequence-tiled MLP."""

    activation_checkpointing: bool = False
    """Recompute each decoder layer's activations in backward instead of storing them."""
    ac_policy: Literal["full", "selective"] = "full"
    """With ``activation_checkpointing``: 'full' keeps each decoder layer's input and recomputes
    the layer; 'selective' recomputes only the norms and the MLP activation
    (``techniques/selective_ac.py``: Megatron's selective scheme, ``34·h/t`` bytes per token and
    layer under TP + sequence parallel, no attention or projection recompute bar ``down_proj``)."""
    activation_offloading: bool = False
    """With ``activation_checkpointing``: each layer's checkpointed input (its hidden states) moves
    to pinned host memory on a side CUDA stream during the forward and comes back, one layer
    ahead, before that layer's backward (``techniques/offload.py``). On CPU a plain copy."""
    tiled_mlp: bool = False
    """Compute each decoder layer's MLP over tiles of the sequence and recompute a tile in backward
    (``techniques/tiled_mlp.py``): its tokens × intermediate activations never exist whole. Also makes
    the HF-Llama-form RMSNorms lean (``techniques/lean_norm.py``): the same output, saving only their
    input and per-token rstd, their backward computed over token tiles."""
    tiled_mlp_num_shards: int | None = None
    """Tiles per MLP call; None: ceil(local tokens / hidden size) (ALST's rule)."""


@dataclass(frozen=True)
class TPOptions:
    plan: dict[str, str] | None = None
    """Module-name pattern -> style ('colwise', 'rowwise', ...); default: the model's own HF plan."""
    sequence_parallel: bool = False
    """Shard norms/dropout activations on the sequence dim (all-gather + reduce-scatter)."""
    sequence_parallel_saved_shards: bool = True
    """Under sequence parallel, save each attention / MLP block's all-gathered input for backward
    as this rank's sequence shard and all-gather it again in backward (Megatron's activation
    bound: one more all-gather per block); False saves the gathered input (tokens × hidden per
    block on every tp rank; ``parallel/tp/sp_saves.py``)."""
    loss_parallel: bool | None = None
    """Cross-entropy on vocab-sharded logits, never gathering the full vocabulary (the logits of
    ``model(...)`` are then a ``Shard(-1)`` DTensor). ``None`` (default): on whenever the plan
    shards the LM head column-wise (the loss is the same either way)."""


@dataclass(frozen=True)
class CPOptions:
    comm_strategy: Literal["ring", "allgather", "ulysses"] = "ring"
    """'ring': K/V rotate rank to rank; 'allgather': K/V gathered once per layer; 'ulysses'
    (Ulysses): heads <-> sequence all-to-all, local attention on cp-th of the heads (query heads per
    TP rank divisible by cp; K/V heads per TP rank divisible by cp or dividing it)."""
    load_balance: bool = True
    """Causal load balancing: rank i holds chunks i and 2·cp−1−i of 2·cp chunks."""


@dataclass(frozen=True)
class PipelineOptions:
    """Pipeline parallel (``pp_size`` > 1; ``parallel/pp/schedule.py``): how the decoder layers are
    split into stages and the order in which stages run their micro-batches."""

    schedule: str = "1F1B"
    """torch's schedule (``torch.distributed.pipelining``): 'GPipe', '1F1B', 'Interleaved1F1B',
    'InterleavedZeroBubble' (several stages per rank), 'ZBVZeroBubble' (two stages per rank in a V)."""
    microbatches: int | None = None
    """Pipeline micro-batches per optimizer step (the step's rows split evenly); None: the step's
    gradient-accumulation micro-batches, one pipeline micro-batch each."""
    virtual_stages: int | None = None
    """Stages per rank; None: 1 for GPipe / 1F1B, 2 for the interleaved and zero-bubble schedules."""
    layers_per_stage: int | None = None
    """Decoder layers of every stage (their number must divide into it); None: an even split."""
    split_points: tuple[int, ...] | None = None
    """Index of the first decoder layer of each stage after the first (torchtitan's split points);
    exclusive with ``layers_per_stage``."""


@dataclass(frozen=True)
class StrategyOptions:
    """Every strategy's options for one run, plus the compute dtype: what ``parallelize_model``
    applies and the engine runs (the trainer, ``verify`` and the Accelerate facade build one)."""

    fsdp: FSDPOptions = FSDPOptions()
    activation: ActivationOptions = ActivationOptions()
    tp: TPOptions = TPOptions()
    cp: CPOptions = CPOptions()
    loss: LossOptions = LossOptions()
    compile: CompileOptions = CompileOptions()
    float8: Float8Options = Float8Options()
    qat: QATOptions = QATOptions()
    pipeline: PipelineOptions = PipelineOptions()
    param_dtype: torch.dtype | None = None
    """Compute dtype of the parallelised model (bf16 or fp16 for mixed precision); None: fp32.
    Master weights, gradient reduction and optimizer states stay fp32 either way (fp16 also needs
    loss scaling: ``engine.LossScaler``)."""

    @classmethod
    def from_kwargs(cls, mixed_precision: str = "no", **kwargs) -> StrategyOptions:
        """From the Accelerator's keyword names (``fsdp_options=``, ``tp_options=``, ...,
        ``mixed_precision="bf16"``), as test setups and scripts write them."""
        names = {
            "fsdp_options": "fsdp",
            "activation_options": "activation",
            "tp_options": "tp",
            "cp_options": "cp",
            "loss_options": "loss",
            "compile_options": "compile",
            "float8_options": "float8",
            "qat_options": "qat",
            "pipeline_options": "pipeline",
        }
        unknown = sorted(set(kwargs) - set(names))
        if unknown:
            raise TypeError(f"unknown strategy option(s) {unknown}: use {sorted(names)}")
        import torch

        dtype = {"no": None, "fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[mixed_precision]
        return cls(param_dtype=dtype, **{names[k]: v for k, v in kwargs.items() if v is not None})
