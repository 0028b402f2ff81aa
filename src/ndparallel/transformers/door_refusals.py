"""What the Trainer door cannot honour, refused in one line naming the ``TrainingArguments`` field and
the fix: when the arguments are built (ndparallel's ``TrainingArguments``) and again when the trainer
is (any ``TrainingArguments``); what depends on the world size, once the layout is resolved."""

from __future__ import annotations

import os

from ndparallel.layout.config import ParallelismConfig


def refuse_unsupported(args) -> None:
    """Raise ``ValueError`` for a ``TrainingArguments`` setting the door cannot honour."""
    if args.deepspeed or os.environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() in ("1", "true"):
        raise ValueError(
            "deepspeed is not supported by ndparallel's Trainer: it shards with FSDP2; drop deepspeed "
            "and set parallelism_config=ParallelismConfig(dp_shard_size=N)"
        )
    if args.fsdp:
        shown = args.fsdp  # a string as given, a list of options or True once transformers read it
        if isinstance(shown, (list, tuple)):
            shown = " ".join(str(getattr(o, "value", o)) for o in shown)
        raise ValueError(
            f"fsdp={shown!r} is not supported by ndparallel's Trainer: it shards every layout itself; "
            "drop fsdp/fsdp_config and set parallelism_config=ParallelismConfig(dp_shard_size=N)"
        )
    pc = args.parallelism_config
    if pc is not None and not isinstance(pc, ParallelismConfig):
        raise ValueError(
            f"parallelism_config is {type(pc).__module__}.{type(pc).__name__}: use ndparallel's "
            "(from ndparallel import ParallelismConfig)"
        )
    if pc is not None and pc.pp_enabled:
        raise ValueError(
            f"parallelism_config.pp_size={pc.pp_size} is not supported by the Trainer door: its loop runs "
            "one forward per micro-batch; set pp_size=1 (pipeline parallel: `ndparallel train`)"
        )
    if args.torch_compile_mode not in (None, "default"):
        raise ValueError(
            f"torch_compile_mode={args.torch_compile_mode!r} is not supported: ndparallel compiles each "
            "decoder layer with the backend's defaults; leave torch_compile_mode unset"
        )
    if str(getattr(args.optim, "value", args.optim)) in ("lomo", "adalomo"):
        raise ValueError(
            f"optim={args.optim!r} (LOMO's fused update) is not supported: use an optim like 'adamw_torch'"
        )


def refuse_per_rank_token_counts(args, dims) -> None:
    """``average_tokens_across_devices=False`` normalises each rank's loss by its own tokens: another
    model than one process trains whenever tokens are split over ranks."""
    if not args.average_tokens_across_devices and dims.dp * dims.cp > 1:
        raise ValueError(
            "average_tokens_across_devices=False divides each rank's loss by its own token count, so "
            f"{dims.describe()} would train another model than one process; leave it True"
        )
