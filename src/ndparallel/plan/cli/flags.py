"""The one table of ``ndparallel plan``'s run flags: each flag is the training config's key
(``--sequence-len`` for ``sequence_len``, ``dp_shard_size=`` in ``--explain``), so a flag pastes into
the YAML and back. A flag's key is also the name of what it sets: a ``Settings`` field, a
``PlanRequest`` field (the searched settings, the batch) or, for the adapter's three flags, what
``from_flags.py`` makes of them together. ``DEPRECATED`` keeps the older spellings for one release.

The model, cluster, output and calibration flags are no run option: ``parser.py`` declares them."""

from __future__ import annotations

from dataclasses import dataclass

from ndparallel.optim.names import OPTIMIZER_NAMES
from ndparallel.plan.settings import OPTIMIZER_STATE_BYTES

GROUPS = (
    "batch, checkpointing and precision",
    "communication and kernels",
    "adapters and quantisation",
    "long context",
    "pipeline",
)
"""The ``--help`` groups of the run's flags, in their order."""
BATCH, COMMS, ADAPTERS, LONG_CONTEXT, PIPELINE = GROUPS


@dataclass(frozen=True)
class Flag:
    """One flag: ``--KEY`` (``_`` written ``-``), or ``--KEY`` / ``--no-KEY`` for a ``switch``."""

    key: str
    """The training config's key, and the name of what it sets."""
    help: str | None
    group: str = BATCH
    choices: tuple | None = None
    positive: bool = False
    """A whole number >= 1."""
    switch: bool = False
    metavar: str | None = None
    optional: str | None = None
    """The value of the flag given bare (``--unsharded-grad-accumulation``: on)."""

    @property
    def option(self) -> str:
        return "--" + self.key.replace("_", "-")


ON_OFF = ("auto", "on", "off", "true", "false")
"""The values of a searched switch: auto (the search tries both), or pinned (true = on)."""

FLAGS = (
    Flag("sequence_len", "sequence length (default 4096)", positive=True),
    Flag(
        "ac_policy",
        "checkpointing policy: full recomputes each layer; selective only the norms and the MLP "
        "activation (Megatron's scheme); op: torchtitan's per-op policy (for comparisons; not run by "
        "ndparallel)",
        choices=("full", "selective", "op"),
    ),
    Flag(
        "mixed_precision",
        "bf16 (default), fp16 or fp32 (a training config's bf16: true / fp16: true / neither)",
        choices=("bf16", "fp16", "fp32"),
    ),
    Flag(
        "optimizer",
        "a training config's optimizer (adamw_torch_fused: fused AdamW; adamw_8bit, paged_adamw_8bit, "
        "adamw_torch_4bit ...: torchao's low-bit AdamW, by their state size; muon: Muon + AdamW, "
        "plan/muon_cost.py) or the planner's adamw_4bit",
        choices=tuple(dict.fromkeys((*OPTIMIZER_STATE_BYTES, *OPTIMIZER_NAMES))),
        metavar="NAME",
    ),
    Flag(
        "chunked_loss",
        "the trainer's memory-efficient loss (default; --no-chunked-loss: whole logits)",
        switch=True,
    ),
    Flag(
        "loss_chunk_tokens",
        "tokens per chunk of the chunked loss (default: 256 MiB of fp32 logits)",
        positive=True,
    ),
    Flag(
        "activation_checkpointing",
        "auto (default): try with and without; on / off (true / false): that",
        choices=ON_OFF,
    ),
    Flag("micro_batch_size", "micro-batch per GPU, or auto (1,2,4,8)"),
    Flag(
        "unsharded_grad_accumulation",
        "accumulate unsharded gradients, reduce-scatter only after the last micro-batch; auto "
        "(default): pp layouts try both, others reduce-scatter every micro-batch",
        choices=ON_OFF,
        optional="on",
    ),
    Flag("sequence_parallel", "TP with sequence parallel (default; --no-: all-reduce)", COMMS, switch=True),
    Flag("loss_parallel", "TP with a vocab-parallel loss (default; --no-: full logits)", COMMS, switch=True),
    Flag(
        "reshard_after_forward",
        "FSDP reshards parameters after forward (default; --no-: kept unsharded until backward)",
        COMMS,
        switch=True,
    ),
    Flag(
        "cp_comm_strategy",
        "context-parallel attention communication; --max-seq-len tries each unless this is given",
        COMMS,
        choices=("ring", "allgather", "ulysses"),
    ),
    Flag(
        "cp_kernel",
        "CP block kernel (flash: what 'auto' runs on CUDA in bf16; math: fp32)",
        COMMS,
        choices=("flash", "math"),
    ),
    Flag(
        "qat",
        "quantisation-aware training: int4, int4/int8, int4/float8, float8/float8 or mxfp4/mxfp4; adds "
        "what the fake quantisers keep for backward",
        ADAPTERS,
        metavar="WEIGHT[/ACT]",
    ),
    Flag(
        "adapter",
        "lora: LoRA on every linear layer, the base frozen in the compute dtype (train's "
        "lora_target_linear: true); qlora: the same on a 4-bit NF4 base (train's load_in_4bit: true)",
        ADAPTERS,
        choices=("none", "lora", "qlora"),
    ),
    Flag("lora_r", "LoRA rank (default 16; needs --adapter lora or qlora)", ADAPTERS, positive=True),
    Flag(
        "lora_modules_to_save",
        "tables trained in full beside the adapters, e.g. embed_tokens,lm_head: a trained copy of "
        "each (one if tied)",
        ADAPTERS,
        metavar="NAMES",
    ),
    Flag("tiled_mlp", "sequence-tiled MLP", LONG_CONTEXT, switch=True),
    Flag(
        "tiled_mlp_num_shards",
        "tiles per MLP call (default: ceil(local tokens / hidden))",
        LONG_CONTEXT,
        positive=True,
    ),
    Flag(
        "activation_offloading",
        "what checkpointing keeps in host memory: full, the layer inputs; selective, its saved tensors "
        "but down_proj's output (turns checkpointing on)",
        LONG_CONTEXT,
        switch=True,
    ),
    Flag(
        "pipeline_schedule",
        "pipeline schedule of the pp layouts: auto (1F1B and Interleaved1F1B), GPipe, 1F1B, "
        "Interleaved1F1B, InterleavedZeroBubble or ZBVZeroBubble",
        PIPELINE,
    ),
    Flag(
        "pipeline_virtual_stages",
        "stages per rank of the interleaved / zero-bubble schedules (default 2)",
        PIPELINE,
        positive=True,
    ),
)
BY_KEY = {f.key: f for f in FLAGS}

DEPRECATED = {
    "--seq-len": "--sequence-len",
    "--micro-batch": "--micro-batch-size",
    "--cp-strategy": "--cp-comm-strategy",
    "--model": "--base-model",
    "--fused-adamw": ("--optimizer", "adamw_torch_fused"),
    "--loss-impl": {"chunked": "--chunked-loss", "full": "--no-chunked-loss"},
}
"""Today's spellings, accepted for one release with a note: the new flag, the new flag and its value,
or (a flag that took a value) the new flag for each value."""
