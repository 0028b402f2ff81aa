"""``ParallelismConfig``: the four parallel degrees, their validation and the ``DeviceMesh``.

The mesh always has the four dims ``(dp_replicate, dp_shard, cp, tp)``, outermost first, size-1 dims
included, so every lookup works for every layout. Flattened views:

* ``dp``          = (dp_replicate, dp_shard): ranks that receive different data;
* ``dp_shard_cp`` = (dp_shard, cp): what FSDP shards parameters over;
* ``dp_cp``       = (dp_replicate, dp_shard, cp): over what loss tokens are counted.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
from dataclasses import dataclass, field
from typing import Mapping

from ndparallel.layout.dims import MESH_DIM_NAMES

_FIELDS = ("dp_replicate_size", "dp_shard_size", "cp_size", "tp_size")
_FIELD_OF_DIM = dict(zip(MESH_DIM_NAMES, _FIELDS))
# Environment variables: ours first, then Hugging Face Accelerate's, so launch scripts written for
# Accelerate keep working unchanged.
ENV_VARS: dict[str, tuple[str, ...]] = {
    "dp_replicate_size": ("NDPARALLEL_DP_REPLICATE_SIZE", "PARALLELISM_CONFIG_DP_REPLICATE_SIZE"),
    "dp_shard_size": ("NDPARALLEL_DP_SHARD_SIZE", "PARALLELISM_CONFIG_DP_SHARD_SIZE"),
    "cp_size": ("NDPARALLEL_CP_SIZE", "PARALLELISM_CONFIG_CP_SIZE"),
    "tp_size": ("NDPARALLEL_TP_SIZE", "PARALLELISM_CONFIG_TP_SIZE"),
}


class ParallelismConfigError(ValueError):
    """An invalid layout; the message names the field(s) and the fix."""


@dataclass(frozen=True)
class ParallelismConfig:
    """Degrees of each parallel dimension; 1 disables a dimension.

    One of ``dp_shard_size`` / ``dp_replicate_size`` may be -1: "fill from the world size".
    ``None`` means "read from the environment, else 1" (see ``ENV_VARS``).
    """

    dp_replicate_size: int | None = None
    """Data-parallel replicas (DDP / the replicate dim of HSDP)."""
    dp_shard_size: int | None = None
    """FSDP2 shard degree (parameters, gradients and optimizer states sharded over it and cp)."""
    tp_size: int | None = None
    """Tensor-parallel degree (innermost: keep it within a node)."""
    cp_size: int | None = None
    """Context-parallel degree (each sequence split over cp ranks)."""
    _resolved: bool = field(default=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in _FIELDS:
            value = getattr(self, name)
            if value is None:
                value = _from_env(name, os.environ)
            object.__setattr__(self, name, _check_size(name, value))
        fills = [n for n in _FIELDS if getattr(self, n) == -1]
        if len(fills) > 1:
            raise ParallelismConfigError(
                f"{' and '.join(fills)} are both -1; only one of dp_shard_size / dp_replicate_size "
                "may be -1 ('fill from the world size'): set the other to an explicit degree"
            )
        if fills and fills[0] not in ("dp_shard_size", "dp_replicate_size"):
            raise ParallelismConfigError(
                f"{fills[0]}=-1 is not allowed: only dp_shard_size or dp_replicate_size may be -1"
            )

    # ------------------------------------------------------------------ sizes
    @property
    def sizes(self) -> dict[str, int]:
        """Mesh dim name -> degree (may contain -1 before ``resolve``)."""
        return {dim: getattr(self, _FIELD_OF_DIM[dim]) for dim in MESH_DIM_NAMES}

    @property
    def total_size(self) -> int:
        """Number of ranks the layout needs (requires a resolved config if a size is -1)."""
        self._require_resolved("total_size")
        return self.dp_replicate_size * self.dp_shard_size * self.cp_size * self.tp_size

    @property
    def dp_size(self) -> int:
        """Ranks that receive different data: dp_replicate × dp_shard."""
        self._require_resolved("dp_size")
        return self.dp_replicate_size * self.dp_shard_size

    @property
    def fsdp_size(self) -> int:
        """Ranks FSDP shards over: dp_shard × cp."""
        self._require_resolved("fsdp_size")
        return self.dp_shard_size * self.cp_size

    @property
    def dp_replicate_enabled(self) -> bool:
        return self.dp_replicate_size != 1

    @property
    def dp_shard_enabled(self) -> bool:
        return self.dp_shard_size != 1

    @property
    def tp_enabled(self) -> bool:
        return self.tp_size != 1

    @property
    def cp_enabled(self) -> bool:
        return self.cp_size != 1

    @property
    def fsdp_enabled(self) -> bool:
        """FSDP applies when parameters are sharded over dp_shard and/or cp."""
        return self.dp_shard_enabled or self.cp_enabled

    @property
    def active_dims(self) -> tuple[str, ...]:
        """Mesh dims whose degree is not 1, outermost first."""
        return tuple(dim for dim, size in self.sizes.items() if size != 1)

    def __repr__(self) -> str:
        s = self.sizes
        layout = " × ".join(f"{dim}={size}" for dim, size in s.items())
        total = self.total_size if -1 not in s.values() else "world"
        return f"ParallelismConfig({layout}; {total} ranks)"

    def describe(self) -> str:
        """Short human name of the layout, e.g. 'HSDP 2×2 + TP 2'."""
        parts = []
        if self.dp_replicate_enabled and self.dp_shard_enabled:
            parts.append(f"HSDP {self.dp_replicate_size}×{self.dp_shard_size}")
        elif self.dp_replicate_enabled:
            parts.append(f"DP {self.dp_replicate_size}")
        elif self.dp_shard_enabled:
            parts.append(f"FSDP {self.dp_shard_size}")
        if self.cp_enabled:
            parts.append(f"CP {self.cp_size}")
        if self.tp_enabled:
            parts.append(f"TP {self.tp_size}")
        return " + ".join(parts) or "single device"

    def to_dict(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in _FIELDS}

    # ------------------------------------------------------------- validation
    def resolve(self, world_size: int) -> "ParallelismConfig":
        """Fill a -1 degree from ``world_size`` and check the product equals it."""
        if world_size < 1:
            raise ParallelismConfigError(f"world size must be >= 1, got {world_size}")
        sizes = self.to_dict()
        fill = next((n for n, v in sizes.items() if v == -1), None)
        if fill is not None:
            rest = 1
            for n, v in sizes.items():
                if n != fill:
                    rest *= v
            if world_size % rest:
                raise ParallelismConfigError(
                    f"{fill}=-1 cannot be filled: the world has {world_size} ranks, which the other "
                    f"degrees ({_product_text(sizes, skip=fill)} = {rest}) do not divide; "
                    "choose degrees whose product divides the world size"
                )
            sizes[fill] = world_size // rest
        product = 1
        for v in sizes.values():
            product *= v
        if product != world_size:
            raise ParallelismConfigError(
                f"dp_replicate_size × dp_shard_size × cp_size × tp_size = {_product_text(sizes)} = "
                f"{product} ranks, but the world has {world_size}; change the degrees so that their "
                f"product is {world_size}, or launch {product} processes"
            )
        return dataclasses.replace(self, **sizes, _resolved=True)

    def _require_resolved(self, what: str) -> None:
        if -1 in self.sizes.values():
            raise ParallelismConfigError(
                f"{what} is unknown while a degree is -1: call .resolve(world_size) first"
            )

    # ------------------------------------------------------------------- mesh
    def build_device_mesh(self, device_type: str, timeout_s: float | None = None):
        """One ``DeviceMesh`` over all ranks with dims (dp_replicate, dp_shard, cp, tp) and the
        flattened ``dp``, ``dp_shard_cp``, ``dp_cp`` views. Needs an initialised process group.
        ``timeout_s``: the collective timeout of every group of the mesh (default: torch's)."""
        import torch.distributed as dist

        from ndparallel.layout.mesh import build_mesh

        if not dist.is_initialized():
            raise RuntimeError(
                "build_device_mesh needs an initialised process group: call "
                "ndparallel.runtime.distributed.init_distributed() (or use Accelerator) first"
            )
        resolved = self.resolve(dist.get_world_size())
        timeout = None if timeout_s is None else datetime.timedelta(seconds=timeout_s)
        return build_mesh(device_type, resolved.sizes, timeout)


def _check_size(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        elif isinstance(value, str) and value.strip().lstrip("-").isdigit():
            value = int(value)
        else:
            raise ParallelismConfigError(
                f"{name} must be an integer >= 1 (or -1 for dp sizes), got {value!r}"
            )
    if value == -1 or value >= 1:
        return value
    raise ParallelismConfigError(
        f"{name}={value} is invalid: use an integer >= 1 (1 disables the dimension)"
        + (", or -1 to fill from the world size" if name.startswith("dp_") else "")
    )


def _from_env(name: str, env: Mapping[str, str]) -> int | str:
    for var in ENV_VARS[name]:
        if var in env and env[var].strip():
            raw = env[var].strip()
            try:
                return int(raw)
            except ValueError:
                raise ParallelismConfigError(
                    f"{name} from environment variable {var}={raw!r} is not an integer"
                ) from None
    return 1


def _product_text(sizes: Mapping[str, int], skip: str | None = None) -> str:
    return "×".join(str(v) for n, v in sizes.items() if n != skip)
