"""The mesh dimensions and ``ParallelDims``: the resolved degrees of one layout and every answer
derived from them (which dims are on, what FSDP shards over, what a sequence length must divide
by, where the experts of a mixture-of-experts model live). The runtime, the data path, the
strategies' checks and the planner all ask this one object.

Expert parallel (torchtitan's rule, experts not tensor-parallel: ``etp = 1``): the ``ep`` ranks
are borrowed from the ranks the dense part already spreads over, ``dp_shard · cp · tp = efsdp · ep``.
The expert mesh is ``(dp_replicate, efsdp, ep)``, ``ep`` innermost: experts are split over ``ep``
(tokens travel there by all-to-all) and FSDP-sharded over ``efsdp`` (HSDP with ``dp_replicate``)."""

from __future__ import annotations

import math
from dataclasses import dataclass

MESH_DIM_NAMES: tuple[str, ...] = ("dp_replicate", "dp_shard", "cp", "tp")
"""The dims inside one pipeline stage (what every strategy but pipeline parallel shards over)."""
PIPELINE_DIM = "pp"
DEVICE_MESH_DIM_NAMES: tuple[str, ...] = (PIPELINE_DIM, *MESH_DIM_NAMES)
"""The built ``DeviceMesh``'s dims, outermost first: pipeline stages outermost (the stage-to-stage
point-to-point traffic is the lightest, so it may cross the slowest links)."""
EXPERT_DIM_NAMES: tuple[str, ...] = ("dp_replicate", "efsdp", "ep")
"""The expert mesh (an unflattened view of the same ranks), ``ep`` innermost."""
FLATTENED_DIMS: dict[str, tuple[str, ...]] = {
    "dp": ("dp_replicate", "dp_shard"),
    "dp_shard_cp": ("dp_shard", "cp"),
    "dp_cp": ("dp_replicate", "dp_shard", "cp"),
}


@dataclass(frozen=True)
class ParallelDims:
    """Degrees in mesh order (pp, dp_replicate, dp_shard, cp, tp), tp innermost; all >= 1. ``ep``
    (expert parallel) multiplies no rank count: it is carved out of dp_shard · cp · tp. ``pp``
    (pipeline stages) multiplies the world: every stage has the layout of the other four dims."""

    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1
    ep: int = 1
    pp: int = 1

    def __post_init__(self) -> None:
        for dim in (*DEVICE_MESH_DIM_NAMES, "ep"):
            value = getattr(self, dim)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"ParallelDims.{dim}={value!r}: degrees are integers >= 1")
        problem = self.ep_problem()
        if problem:
            raise ValueError(problem)

    def ep_problem(self) -> str | None:
        """Why ``ep`` does not fit the dense degrees (it must divide dp_shard · cp · tp), or None."""
        borrowed = self.dp_shard * self.cp * self.tp
        if borrowed % self.ep == 0:
            return None
        fits = [d for d in range(1, borrowed + 1) if borrowed % d == 0]
        return (
            f"expert_parallel_size={self.ep} must divide dp_shard × cp × tp = {self.dp_shard}×{self.cp}×"
            f"{self.tp} = {borrowed}: the expert-parallel ranks are borrowed from the ranks the dense "
            f"layers shard over (torchtitan's rule). Use expert_parallel_size in {fits}, or raise "
            f"dp_shard_size so that it divides (e.g. "
            f"dp_shard_size={self.dp_shard * self.ep // math.gcd(borrowed, self.ep)})"
        )

    # ------------------------------------------------------------------ sizes
    @property
    def world(self) -> int:
        return self.pp * self.stage_world

    @property
    def stage_world(self) -> int:
        """Ranks of one pipeline stage (the whole world without pipeline parallel)."""
        return self.dp_replicate * self.dp_shard * self.cp * self.tp

    @property
    def dp(self) -> int:
        """Ranks that see different samples (dp_replicate × dp_shard)."""
        return self.dp_replicate * self.dp_shard

    @property
    def fsdp(self) -> int:
        """Ranks FSDP shards parameters over (dp_shard × cp)."""
        return self.dp_shard * self.cp

    @property
    def efsdp(self) -> int:
        """Ranks FSDP shards each expert's weights over: dp_shard · cp · tp / ep (etp = 1)."""
        return self.dp_shard * self.cp * self.tp // self.ep

    def size(self, dim: str) -> int:
        """Degree of a base, flattened or expert mesh dim (``efsdp``, ``ep``)."""
        if dim in ("efsdp", "ep"):
            return getattr(self, dim)
        return math.prod(getattr(self, d) for d in FLATTENED_DIMS.get(dim, (dim,)))

    def inner_size(self, dim: str) -> int:
        """Product of the degrees inside ``dim`` (the rank stride of its groups)."""
        if dim in ("efsdp", "ep"):  # the expert mesh: ep innermost, efsdp right outside it
            return self.ep if dim == "efsdp" else 1
        last = FLATTENED_DIMS.get(dim, (dim,))[-1]
        names = DEVICE_MESH_DIM_NAMES
        return math.prod(getattr(self, d) for d in names[names.index(last) + 1 :])

    def tp_across_nodes(self, ranks_per_node: int) -> str | None:
        """Why tp groups would span nodes when each node runs ``ranks_per_node`` consecutive
        ranks (tp is innermost: a tp group is ``tp`` consecutive ranks), or None."""
        if self.tp <= 1 or ranks_per_node >= self.world or ranks_per_node % self.tp == 0:
            return None
        return (
            f"tensor_parallel_size={self.tp} spans nodes: a node runs {ranks_per_node} rank(s) and a tp "
            f"group is {self.tp} consecutive ranks, so every layer's tensor-parallel all-reduces would cross "
            f"the inter-node network; keep tp within a node (a divisor of {ranks_per_node}) and use "
            "dp_shard / dp_replicate across nodes"
        )

    @property
    def sizes(self) -> dict[str, int]:
        """Degree of every dim of the built mesh (``DEVICE_MESH_DIM_NAMES``), pp first."""
        return {d: getattr(self, d) for d in DEVICE_MESH_DIM_NAMES}

    def to_dict(self) -> dict[str, int]:
        """The degrees under ``ParallelismConfig``'s field names (as checkpoints record them);
        ``ep_size`` / ``pp_size`` only when expert / pipeline parallel is on."""
        out = {
            "dp_replicate_size": self.dp_replicate,
            "dp_shard_size": self.dp_shard,
            "cp_size": self.cp,
            "tp_size": self.tp,
        }
        if self.ep > 1:
            out["ep_size"] = self.ep
        if self.pp > 1:
            out["pp_size"] = self.pp
        return out

    # ---------------------------------------------------------------- enabled
    dp_replicate_enabled = property(lambda self: self.dp_replicate > 1)
    dp_shard_enabled = property(lambda self: self.dp_shard > 1)
    cp_enabled = property(lambda self: self.cp > 1)
    tp_enabled = property(lambda self: self.tp > 1)
    ep_enabled = property(lambda self: self.ep > 1)
    pp_enabled = property(lambda self: self.pp > 1)

    @property
    def fsdp_enabled(self) -> bool:
        """Parameters are sharded (over dp_shard and/or cp)."""
        return self.fsdp > 1

    @property
    def fsdp_dims(self) -> tuple[str, ...]:
        """The mesh dims FSDP2 runs on: (dp_replicate, dp_shard_cp) for HSDP, else (dp_shard_cp,)."""
        return ("dp_replicate", "dp_shard_cp") if self.dp_replicate_enabled else ("dp_shard_cp",)

    def expert_fsdp_dims(self) -> tuple[str, ...]:
        """The expert-mesh dims FSDP2 runs the experts on: (dp_replicate, efsdp) or (efsdp,)."""
        return ("dp_replicate", "efsdp") if self.dp_replicate_enabled else ("efsdp",)

    def experts_split(self, moe: bool) -> bool:
        """Whether a model's experts leave the dense layout (``parallel/ep/expert.py``): under expert
        parallel, and under TP (experts are never tensor-parallel: each tp rank runs all its
        experts on its own share of the tokens)."""
        return moe and (self.ep_enabled or self.tp_enabled)

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
        parts = [f"PP {self.pp}"] if self.pp_enabled else []
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
        if self.ep_enabled:
            parts.append(f"EP {self.ep}")
        return " + ".join(parts) or "single device"

    def compact(self) -> str:
        ep = f"+ep{self.ep}" if self.ep_enabled else ""
        pp = f"pp{self.pp}:" if self.pp_enabled else ""
        return f"{pp}{self.dp_replicate}x{self.dp_shard}x{self.cp}x{self.tp}{ep}"
