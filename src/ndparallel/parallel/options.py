"""Options of each parallel strategy, as small dataclasses (documented fields, no logic)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch


@dataclass(frozen=True)
class FSDPOptions:
    reshard_after_forward: bool = True
    """Free the gathered parameters after forward (re-gather in backward): less memory, more comm."""
    cpu_offload: bool = False
    """Keep sharded parameters, gradients and optimizer states in host memory."""
    activation_checkpointing: bool = False
    """Recompute each decoder layer's activations in backward instead of storing them."""
    layer_classes: tuple[str, ...] | None = None
    """Class names of the blocks to shard one by one; default: the model's ``_no_split_modules``."""
    unsharded_grad_accumulation: bool = False
    """During gradient accumulation, skip the reduce-scatter too and keep *unsharded* gradients
    until the last micro-batch (less communication, but a full-size gradient per rank). Default:
    reduce-scatter every micro-batch so gradients stay sharded; only the replica all-reduce (DP /
    HSDP) waits for the last micro-batch."""
    reduce_dtype: torch.dtype | None = None
    """dtype of the gradient reduce-scatter / all-reduce; None = fp32 (exact sums under bf16)."""


@dataclass(frozen=True)
class TPOptions:
    plan: dict[str, str] | None = None
    """Module-name pattern -> style ('colwise', 'rowwise', ...); default: the model's own HF plan."""
    sequence_parallel: bool = False
    """Shard norms/dropout activations on the sequence dim (all-gather + reduce-scatter)."""
    loss_parallel: bool = False
    """Cross-entropy on vocab-sharded logits, never gathering the full vocabulary."""


@dataclass(frozen=True)
class CPOptions:
    comm_strategy: Literal["ring", "allgather", "alltoall"] = "ring"
    """'ring': K/V rotate rank to rank; 'allgather': K/V gathered once per layer; 'alltoall'
    (Ulysses): heads <-> sequence all-to-all, local attention on cp-th of the heads (query heads per
    TP rank divisible by cp; K/V heads per TP rank divisible by cp or dividing it)."""
    load_balance: bool = True
    """Causal load balancing: rank i holds chunks i and 2·cp−1−i of 2·cp chunks."""

