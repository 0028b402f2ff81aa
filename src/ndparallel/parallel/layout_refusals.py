"""Refusals that depend only on degrees and option values, not on a model: shared by the runtime
(``parallel/support.py``, ``parallel/parallelize.py``, ``config/``) and the planner, which asks
them instead of restating them. Imports nothing heavy (``ndparallel plan`` starts without torch)."""

from __future__ import annotations

from collections.abc import Sequence


def saved_modules_problem(saved: Sequence[str], tp_size: int) -> str | None:
    """Why LoRA's ``modules_to_save`` named ``saved`` cannot train under ``tp_size``, or None: the
    embedding and LM head are vocab-sharded under TP, their trained PEFT copies would not be."""
    if saved and tp_size > 1:
        return (
            f"tensor_parallel_size={tp_size}: LoRA's modules_to_save ({', '.join(saved)}) are trained whole, "
            "not vocab-sharded: drop lora_modules_to_save or set tensor_parallel_size: 1 (use dp_shard_size)"
        )
    return None


def qat_layout_problem(tp_size: int, float8: bool) -> str | None:
    """What QAT cannot be combined with (None: nothing here): TP (the fake quantisers' group and
    per-token scales are not written for DTensor shards: a row-sharded input would be scaled per
    shard), float8 training (both replace the same linears)."""
    if tp_size > 1:
        return (
            f"qat with tensor_parallel_size={tp_size} is not supported (torchao's fake quantisers would "
            "compute their scales on TP shards, not whole rows): shard with dp_shard_size (FSDP2, exact "
            "under QAT) and set tensor_parallel_size: 1"
        )
    if float8:
        return "qat and fp8 both replace the linear layers: use one of them (remove fp8 or qat)"
    return None
