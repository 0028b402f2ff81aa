"""QLoRA before any rank starts (``train``, ``--dry-run``, ``verify``): torchao importable, the NF4
weights fit the layout (no tensor parallel; every FSDP shard whole rows and whole scaler blocks),
and the one-line summary ``--dry-run`` prints. Shapes only: nothing is quantised here."""

from __future__ import annotations

import math

from ndparallel.config import ConfigError, TrainConfig
from ndparallel.models.adapters import apply_adapter, base_model_of
from ndparallel.models.nf4_config import NF4_BYTES_PER_PARAM
from ndparallel.models.quantized import (
    layout_problem,
    nf4_shard_count,
    quantized_linears,
    require_torchao,
)
from ndparallel.preflight.model_check import meta_model, quiet_transformers


def check_quantized_base(cfg: TrainConfig, hf, pc) -> str | None:
    """Raise ``ConfigError`` (one line, the fix) when the 4-bit base cannot run on layout ``pc``;
    return the summary line (None without ``load_in_4bit``)."""
    if not cfg.load_in_4bit:
        return None

    try:
        require_torchao()
    except ImportError as e:
        raise ConfigError(f"load_in_4bit: {e}") from None
    import torch

    config = cfg.nf4_config()
    # check_adapter (run first) has named any problem of the LoRA config; LoRA layers on meta too
    with quiet_transformers(), torch.device("meta"):
        base = base_model_of(apply_adapter(meta_model(cfg, hf), cfg.lora_config()))
    names, kept = quantized_linears(base, config)
    modules = dict(base.named_modules())
    shapes = {n: tuple(modules[n].weight.shape) for n in names}
    problem = layout_problem(
        {n: nf4_shard_count(s, config) for n, s in shapes.items()}, pc.fsdp_size, pc.tp_size
    )
    if problem:
        raise ConfigError(problem)
    if not names:
        raise ConfigError(
            f"load_in_4bit: no linear layer of base_model={cfg.base_model!r} holds whole NF4 groups of "
            f"{config.group} values: nothing to quantise (use adapter: lora)"
        )
    params = sum(math.prod(s) for s in shapes.values())
    rest = cfg.compute_dtype_name()
    kept_note = (
        f"; {len(kept)} linear(s) kept in {rest} (not whole {config.group}-value groups, e.g. {kept[0]})"
        if kept
        else ""
    )
    size = params * NF4_BYTES_PER_PARAM
    size_text = f"{size / 2**30:,.2f} GiB" if size >= 2**30 else f"{size / 2**20:,.2f} MiB"
    return (
        f"4-bit NF4 (torchao) on {len(names)} linears: {params / 1e6:,.2f}M params x "
        f"{NF4_BYTES_PER_PARAM:.3f} byte = {size_text}"
        f"{f' (/{pc.fsdp_size} per rank)' if pc.fsdp_size > 1 else ''}; embeddings, norms, "
        f"lm_head in {rest}{kept_note}"
    )
