"""The mesh dimensions and ``ParallelDims``: the resolved degrees of one layout and every answer
derived from them (which dims are on, what FSDP shards over, what a sequence length must divide
by). The runtime, the data path, the strategies' checks and the planner all ask this one object."""

from __future__ import annotations

import math
from dataclasses import dataclass

MESH_DIM_NAMES: tuple[str, ...] = ("dp_replicate", "dp_shard", "cp", "tp")
FLATTENED_DIMS: dict[str, tuple[str, ...]] = {
    "dp": ("dp_replicate", "dp_shard"),
    "dp_shard_cp": ("dp_shard", "cp"),
    "dp_cp": ("dp_replicate", "dp_shard", "cp"),
}


@dataclass(frozen=True)
class ParallelDims:
    """Degrees in mesh order (dp_replicate, dp_shard, cp, tp), tp innermost; all >= 1."""

    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1

    def __post_init__(self) -> None:
        for dim in MESH_DIM_NAMES:
            value = getattr(self, dim)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"ParallelDims.{dim}={value!r}: degrees are integers >= 1")

    # ------------------------------------------------------------------ sizes
    @property
    def world(self) -> int:
        return self.dp_replicate * self.dp_shard * self.cp * self.tp

    @property
    def dp(self) -> int:
        """Ranks that see different samples (dp_replicate × dp_shard)."""
        return self.dp_replicate * self.dp_shard

    @property
    def fsdp(self) -> int:
        """Ranks FSDP shards parameters over (dp_shard × cp)."""
        return self.dp_shard * self.cp

    def size(self, dim: str) -> int:
        """Degree of a base or flattened mesh dim."""
        return math.prod(getattr(self, d) for d in FLATTENED_DIMS.get(dim, (dim,)))

    def inner_size(self, dim: str) -> int:
        """Product of the degrees inside ``dim`` (the rank stride of its groups)."""
        last = FLATTENED_DIMS.get(dim, (dim,))[-1]
        return math.prod(getattr(self, d) for d in MESH_DIM_NAMES[MESH_DIM_NAMES.index(last) + 1:])

    @property
    def sizes(self) -> dict[str, int]:
        return {d: getattr(self, d) for d in MESH_DIM_NAMES}

    def to_dict(self) -> dict[str, int]:
        """The degrees under ``ParallelismConfig``'s field names (as checkpoints record them)."""
        return {"dp_replicate_size": self.dp_replicate, "dp_shard_size": self.dp_shard,
                "cp_size": self.cp, "tp_size": self.tp}

    # ---------------------------------------------------------------- enabled
    dp_replicate_enabled = property(lambda self: self.dp_replicate > 1)
    dp_shard_enabled = property(lambda self: self.dp_shard > 1)
    cp_enabled = property(lambda self: self.cp > 1)
    tp_enabled = property(lambda self: self.tp > 1)

    @property
    def fsdp_enabled(self) -> bool:
        """Parameters are sharded (over dp_shard and/or cp)."""
        return self.fsdp > 1

    @property
    def fsdp_dims(self) -> tuple[str, ...]:
        """The mesh dims FSDP2 runs on: (dp_replicate, dp_shard_cp) for HSDP, else (dp_shard_cp,)."""
        return ("dp_replicate", "dp_shard_cp") if self.dp_replicate_enabled else ("dp_shard_cp",)

    # --------------------------------------------------------------- sequences
    def cp_chunks(self, load_balance: bool = True) -> int:
        """Chunks a sequence is cut into for CP: 2·cp when load-balanced for causal attention
        (rank i holds chunks i and 2·cp−1−i), cp otherwise; 1 without CP."""
        if not self.cp_enabled:
            return 1
        return 2 * self.cp if load_balance else self.cp

    def seq_len_divisor(self, sequence_parallel: bool = False, cp_load_balance: bool = True) -> int:
        """What every sequence length must be a multiple of under this layout: the CP chunk count,
        and with sequence parallel also cp·tp (each cp rank's tokens are split over tp)."""
        divisor = self.cp_chunks(cp_load_balance)
        if sequence_parallel and self.tp_enabled:
            divisor = math.lcm(divisor, self.cp * self.tp)
        return divisor

    # ------------------------------------------------------------------ names
    def describe(self) -> str:
        """Short human name, e.g. 'HSDP 2×2 + TP 2' ('single device' for 1×1×1×1)."""
        parts = []
        if self.dp_replicate_enabled and self.dp_shard_enabled:
            parts.append(f"HSDP {self.dp_replicate}×{self.dp_shard}")
        elif self.dp_replicate_enabled:
            parts.append(f"DP {self.dp_replicate}")
        elif self.dp_shard_enabled:
            parts.append(f"FSDP {self.dp_shard}")
        if self.cp_enabled:
            parts.append(f"CP {self.cp}")
        if self.tp_enabled:
            parts.append(f"TP {self.tp}")
        return " + ".join(parts) or "single device"

    def short(self) -> str:
        return f"dp_replicate={self.dp_replicate},dp_shard={self.dp_shard},cp={self.cp},tp={self.tp}"

    def compact(self) -> str:
        return f"{self.dp_replicate}x{self.dp_shard}x{self.cp}x{self.tp}"
