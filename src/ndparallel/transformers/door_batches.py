"""A Trainer batch made ready for the layout before the model sees it: labels shifted *before* the
sequence is split (``shift_labels``), the global ``position_ids``, the length padded to what the
layout divides (``ParallelDims.seq_len_divisor``: CP's chunks, sequence parallel's tp ranks) with
ignored labels and positions that continue, so the padding changes no real token's output. What
cannot be split exactly is refused in one line."""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F

from ndparallel.parallel.cp.sharding import pad_for_cp
from ndparallel.techniques.loss import IGNORE_INDEX

SEQUENCE_KEYS = ("input_ids", "shift_labels", "position_ids")
"""The columns split along the sequence under context parallelism, in this order."""
BOUNDARY_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx")
"""What a padding-free collator derives from ``position_ids`` for varlen kernels (TRL's): dropped where
the sequence is padded or split, ndparallel's attention reading the documents from the positions."""
LOSS_KEYS = frozenset({"input_ids", "labels", "shift_labels", "position_ids", "attention_mask", "use_cache"})
"""A batch of only these is a plain causal-LM batch: the engine's own loss can take it."""


def shift(labels: torch.Tensor) -> torch.Tensor:
    """``shift_labels[:, t] = labels[:, t+1]``, ignored at the end (what a causal LM's loss does)."""
    return F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:].contiguous()


def loss_labels(inputs: Mapping, shifts: bool = True) -> torch.Tensor | None:
    """The batch's targets as shifted labels (``shift_labels``, or ``labels`` shifted when the
    model's loss shifts them), None without labels."""
    if "shift_labels" in inputs:
        return inputs["shift_labels"]
    if "labels" in inputs and isinstance(inputs["labels"], torch.Tensor):
        return shift(inputs["labels"]) if shifts else inputs["labels"]
    return None


def _padding_mask_problem(mask: torch.Tensor, where: str) -> str | None:
    if mask.dim() != 2 or bool(mask.all()):
        return None
    return (
        f"{where}: the batch has a padding attention_mask, which a split sequence cannot take; "
        "pack the rows (TRL: packing=True or padding_free=True) or pad to one length with ignored labels"
    )


def layout_inputs(inputs: Mapping, divisor: int, cp: bool, where: str) -> dict:
    """``inputs`` for a layout whose sequences must divide by ``divisor`` (and, with ``cp``, are split
    over the cp ranks): a new dict; ``labels`` are replaced by ``shift_labels`` under CP (a model
    would shift them after the split, pairing tokens with the wrong targets at every shard edge)."""
    out = {k: v for k, v in inputs.items() if k not in BOUNDARY_KEYS}
    ids = out["input_ids"]
    if loss_labels(out) is not None and "shift_labels" not in out:
        out["shift_labels"] = shift(out["labels"])
    if cp:
        out.pop("labels", None)
    if out.get("position_ids") is None:
        out["position_ids"] = torch.arange(ids.shape[1], device=ids.device).expand(ids.shape[0], -1)
    mask = out.get("attention_mask")
    if isinstance(mask, torch.Tensor):
        problem = _padding_mask_problem(mask, where)
        if problem:
            raise ValueError(problem)
        out.pop("attention_mask")
    if cp:
        seq = ids.shape[1]
        other = [
            k
            for k, v in out.items()
            if k not in SEQUENCE_KEYS and isinstance(v, torch.Tensor) and v.dim() > 1 and v.shape[1] == seq
        ]
        if other:
            raise ValueError(
                f"{where}: batch column {other[0]!r} has the sequence length, and nothing splits it over "
                "the cp ranks: context parallelism takes input_ids, labels / shift_labels and position_ids"
            )
    return pad_for_cp(out, 1, pad_token_id=0, multiple_of=divisor)
