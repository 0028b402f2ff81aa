"""``ParallelismConfig``: the parallel degrees, their validation and the ``DeviceMesh``.

The mesh always has the five dims ``(pp, dp_replicate, dp_shard, cp, tp)``, outermost first, size-1
dims included, so every lookup works for every layout. ``pp_size`` (pipeline stages) is ndparallel's
own field: Accelerate's ``ParallelismConfig`` has none. Flattened views (inside one pipeline stage):

* ``dp``          = (dp_replicate, dp_shard): ranks that receive different data;
* ``dp_shard_cp`` = (dp_shard, cp): what FSDP shards parameters over;
* ``dp_cp``       = (dp_replicate, dp_shard, cp): over what loss tokens are counted.

``ep_size`` (expert parallel, mixture-of-experts models) adds no rank: it is carved out of
dp_shard × cp × tp (``ParallelDims``; the expert mesh is built by ``layout.mesh.build_expert_mesh``).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ndparallel.layout.dim_handlers import (
    TorchContextParallelConfig,
    TorchTensorParallelConfig,
)
from ndparallel.layout.dims import DEVICE_MESH_DIM_NAMES, ParallelDims

_FIELDS = ("dp_replicate_size", "dp_shard_size", "cp_size", "tp_size")
_SIZE_FIELDS = ("pp_size", *_FIELDS)
_FIELD_OF_DIM = dict(zip(DEVICE_MESH_DIM_NAMES, _SIZE_FIELDS))
# Environment variables: ours first, then Hugging Face Accelerate's, so launch scripts written for
# Accelerate keep working unchanged.
ENV_VARS: dict[str, tuple[str, ...]] = {
    "dp_replicate_size": ("NDPARALLEL_DP_REPLICATE_SIZE", "PARALLELISM_CONFIG_DP_REPLICATE_SIZE"),
    "dp_shard_size": ("NDPARALLEL_DP_SHARD_SIZE", "PARALLELISM_CONFIG_DP_SHARD_SIZE"),
    "cp_size": ("NDPARALLEL_CP_SIZE", "PARALLELISM_CONFIG_CP_SIZE"),
    "tp_size": ("NDPARALLEL_TP_SIZE", "PARALLELISM_CONFIG_TP_SIZE"),
    "ep_size": ("NDPARALLEL_EP_SIZE",),
    "pp_size": ("NDPARALLEL_PP_SIZE",),
}


class ParallelismConfigError(ValueError):
    """An invalid layout; the message names the field(s) and the fix."""


@dataclass
class ParallelismConfig:
    """Degrees of each parallel dimension; 1 disables a dimension (Hugging Face Accelerate's
    class, a plain dataclass as there; ``dims`` is the typed, resolved view the engine uses).

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
    cp_backend: str | None = None
    """Accelerate's CP backend name; only ``"torch"`` (None: ``PARALLELISM_CONFIG_CP_BACKEND``)."""
    sp_size: int | None = None
    """Accelerate's DeepSpeed-Ulysses degree: only 1 (use ``cp_size``)."""
    sp_backend: str | None = None
    """Accelerate's SP backend name; unused while ``sp_size`` is 1."""
    tp_handler: TorchTensorParallelConfig | None = None
    """Tensor-parallel handler (created when ``tp_size > 1``, as Accelerate does)."""
    cp_handler: TorchContextParallelConfig | None = None
    """Context-parallel handler: the K/V exchange strategy (created when ``cp_size > 1``)."""
    sp_handler: Any = None
    """Accelerate's DeepSpeed SP handler: must stay None."""
    ep_size: int | None = None
    """Expert-parallel degree of a mixture-of-experts model (experts split over ep ranks, tokens
    sent to them by all-to-all). Adds no rank: it must divide dp_shard × cp × tp (torchtitan's
    rule); ndparallel's own field (Accelerate has none), ``expert_parallel_size`` in YAML."""
    pp_size: int | None = None
    """Pipeline stages: the decoder layers split over pp groups of ranks, each stage laid out by the
    other four degrees (outermost mesh dim). ndparallel's own field (Accelerate has none),
    ``pipeline_parallel_size`` in YAML; the schedule and micro-batches are ``PipelineOptions``."""
    _resolved: bool = field(default=False, repr=False, compare=False)
    device_mesh: Any = field(default=None, init=False, repr=False, compare=False)
    """The mesh built for this config (Accelerate's cache; ``get_device_mesh``)."""

    def __post_init__(self) -> None:
        for name in _FIELDS:
            value = getattr(self, name)
            if value is None:
                value = _from_env(name, os.environ)
            setattr(self, name, _check_size(name, value))
        for name, what in (("ep_size", "expert-parallel degree"), ("pp_size", "number of pipeline stages")):
            value = getattr(self, name)
            value = _check_size(name, value if value is not None else _from_env(name, os.environ))
            if value == -1:
                raise ParallelismConfigError(f"{name}=-1 is not allowed: give the {what} (>= 1)")
            setattr(self, name, value)
        _check_accelerate_fields(self)
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
        """Mesh dim name -> degree, pp first (may contain -1 before ``resolve``)."""
        return {dim: getattr(self, _FIELD_OF_DIM[dim]) for dim in DEVICE_MESH_DIM_NAMES}

    @property
    def total_size(self) -> int:
        """Number of ranks the layout needs (requires a resolved config if a size is -1)."""
        self._require_resolved("total_size")
        return self.pp_size * self.dp_replicate_size * self.dp_shard_size * self.cp_size * self.tp_size

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
    def data_parallel_size(self) -> int:
        """Accelerate's name for ``dp_size``."""
        return self.dp_size

    @property
    def non_data_parallel_size(self) -> int:
        """Ranks that share one sample: tp × cp (Accelerate: × sp, always 1 here)."""
        self._require_resolved("non_data_parallel_size")
        return self.tp_size * self.cp_size

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
    def ep_enabled(self) -> bool:
        return self.ep_size != 1

    @property
    def cp_enabled(self) -> bool:
        return self.cp_size != 1

    @property
    def pp_enabled(self) -> bool:
        return self.pp_size != 1

    @property
    def fsdp_enabled(self) -> bool:
        """FSDP applies when parameters are sharded over dp_shard and/or cp."""
        return self.dp_shard_enabled or self.cp_enabled

    @property
    def sp_enabled(self) -> bool:
        """Accelerate's DeepSpeed SP: never enabled here (``sp_size`` must be 1)."""
        return False

    @property
    def active_dims(self) -> tuple[str, ...]:
        """Mesh dims whose degree is not 1, outermost first."""
        return tuple(dim for dim, size in self.sizes.items() if size != 1)

    # Accelerate's lists of *enabled* dim names. Our mesh always has all five dims (size-1 dims
    # included), so every name these lists can hold is a valid key of ``build_device_mesh()``.
    @property
    def dp_dim_names(self) -> list[str]:
        return [
            d
            for d, on in (("dp_replicate", self.dp_replicate_enabled), ("dp_shard", self.dp_shard_enabled))
            if on
        ]

    @property
    def non_dp_dim_names(self) -> list[str]:
        return [d for d, on in (("tp", self.tp_enabled), ("cp", self.cp_enabled)) if on]

    @property
    def dp_shard_cp_dim_names(self) -> list[str]:
        return [d for d, on in (("dp_shard", self.dp_shard_enabled), ("cp", self.cp_enabled)) if on]

    @property
    def dp_cp_dim_names(self) -> list[str]:
        """Enabled dims over which the loss is averaged (data-parallel and context-parallel)."""
        return self.dp_dim_names + (["cp"] if self.cp_enabled else [])

    @property
    def fsdp_dim_names(self) -> list[str]:
        return (["dp_replicate"] if self.dp_replicate_enabled else []) + ["dp_shard_cp"]

    @property
    def active_mesh_dims(self) -> list[str]:
        return self.dp_dim_names + self.non_dp_dim_names

    def __repr__(self) -> str:
        s = self.sizes
        layout = " × ".join(f"{dim}={size}" for dim, size in s.items() if dim != "pp" or size != 1)
        total = self.total_size if -1 not in s.values() else "world"
        ep = f"; ep={self.ep_size}" if self.ep_enabled else ""
        return f"ParallelismConfig({layout}{ep}; {total} ranks)"

    @property
    def dims(self) -> ParallelDims:
        """The resolved degrees as the engine's typed ``ParallelDims`` (requires no -1 left)."""
        self._require_resolved("dims")
        try:
            return ParallelDims(
                self.dp_replicate_size,
                self.dp_shard_size,
                self.cp_size,
                self.tp_size,
                self.ep_size,
                self.pp_size,
            )
        except ValueError as e:
            raise ParallelismConfigError(str(e)) from None

    def describe(self) -> str:
        """Short human name of the layout, e.g. 'HSDP 2×2 + TP 2'."""
        return self.dims.describe()

    def to_dict(self) -> dict[str, int]:
        """The degrees (``ep_size`` / ``pp_size`` only when expert / pipeline parallel is on)."""
        out = {name: getattr(self, name) for name in _FIELDS}
        if self.ep_enabled:
            out["ep_size"] = self.ep_size
        if self.pp_enabled:
            out["pp_size"] = self.pp_size
        return out

    def to_json(self) -> str:
        """The degrees and handler choices as JSON (Accelerate's ``to_json`` returns None)."""
        out: dict[str, Any] = {**self.to_dict(), "cp_backend": self.cp_backend, "sp_size": self.sp_size}
        for name in ("tp_handler", "cp_handler"):
            handler = getattr(self, name)
            out[name] = dataclasses.asdict(handler) if handler is not None else None
        return json.dumps(out, sort_keys=True)

    # ------------------------------------------------------------- validation
    def resolve(self, world_size: int) -> ParallelismConfig:
        """Fill a -1 degree from ``world_size`` and check the product equals it."""
        if world_size < 1:
            raise ParallelismConfigError(f"world size must be >= 1, got {world_size}")
        sizes = {name: getattr(self, name) for name in _SIZE_FIELDS}
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
            names = (
                "pp_size × " if sizes["pp_size"] != 1 else ""
            ) + "dp_replicate_size × dp_shard_size × cp_size × tp_size"
            raise ParallelismConfigError(
                f"{names} = {_product_text(sizes)} = "
                f"{product} ranks, but the world has {world_size}; change the degrees so that their "
                f"product is {world_size}, or launch {product} processes"
                + _ep_hint(self.ep_size, sizes, world_size)
            )
        resolved = dataclasses.replace(self, **sizes, _resolved=True)
        resolved.dims  # noqa: B018 - raises when ep does not divide dp_shard × cp × tp
        return resolved

    def _require_resolved(self, what: str) -> None:
        if -1 in self.sizes.values():
            raise ParallelismConfigError(
                f"{what} is unknown while a degree is -1: call .resolve(world_size) first"
            )

    # ------------------------------------------------------------------- mesh
    def build_device_mesh(self, device_type: str, timeout_s: float | None = None):
        """One ``DeviceMesh`` over all ranks with dims (pp, dp_replicate, dp_shard, cp, tp) and the
        flattened ``dp``, ``dp_shard_cp``, ``dp_cp`` views. Without a process group it starts the
        default one first, as torch's ``init_device_mesh`` does (``torchrun`` env vars; a one-rank
        group when there are none). ``timeout_s``: the collective timeout of every group of the mesh
        (default: torch's)."""
        import torch.distributed as dist

        from ndparallel.layout.mesh import build_mesh, ensure_default_group

        ensure_default_group(device_type)
        resolved = self.resolve(dist.get_world_size())
        timeout = None if timeout_s is None else datetime.timedelta(seconds=timeout_s)
        return build_mesh(device_type, resolved.sizes, timeout)

    def get_device_mesh(self, device_type: str | None = None):
        """The mesh built for this config (kept on it, as Accelerate does); ``device_type`` builds
        it on first use and must match afterwards."""
        if self.device_mesh is None:
            if device_type is None:
                raise ValueError("no device mesh built yet: pass a device_type, e.g. get_device_mesh('cuda')")
            self.device_mesh = self.build_device_mesh(device_type)
        elif device_type is not None and self.device_mesh.device_type != device_type:
            raise ValueError(
                f"the device mesh was built for {self.device_mesh.device_type!r}, not {device_type!r}"
            )
        return self.device_mesh


def _check_accelerate_fields(pc: ParallelismConfig) -> None:
    """Fill and check the fields that exist for Accelerate's API (backends, SP, handlers)."""
    env = os.environ
    backend = pc.cp_backend or env.get("PARALLELISM_CONFIG_CP_BACKEND", "").strip() or "torch"
    if backend != "torch":
        raise ParallelismConfigError(
            f"cp_backend={backend!r} is not supported: use cp_backend='torch' (ndparallel's own "
            "ring/all-gather attention; DeepSpeed Ulysses is not available)"
        )
    sp = pc.sp_size if pc.sp_size is not None else env.get("PARALLELISM_CONFIG_SP_SIZE", "").strip() or 1
    sp = _check_size("sp_size", sp)
    if sp != 1:
        raise ParallelismConfigError(
            f"sp_size={sp} (DeepSpeed-Ulysses sequence parallelism) is not supported: split the "
            f"sequence with cp_size={sp} (context parallelism) instead"
        )
    if pc.sp_handler is not None:
        raise ParallelismConfigError(
            "sp_handler is not supported (no DeepSpeed SP): leave it None, use cp_size"
        )
    pc.cp_backend, pc.sp_size = backend, 1
    pc.sp_backend = pc.sp_backend or env.get("PARALLELISM_CONFIG_SP_BACKEND") or "deepspeed"
    for name, cls, size in (
        ("tp_handler", TorchTensorParallelConfig, pc.tp_size),
        ("cp_handler", TorchContextParallelConfig, pc.cp_size),
    ):
        handler = getattr(pc, name)
        if handler is None and size != 1:
            setattr(pc, name, cls())
        elif handler is not None and not isinstance(handler, cls):
            raise ParallelismConfigError(f"{name} must be a {cls.__name__}, got {type(handler).__name__}")


def _ep_hint(ep: int, sizes: Mapping[str, int], world: int) -> str:
    """A note for Axolotl users, whose ``expert_parallel_size`` multiplies the world (ep × dp_shard
    = world size): here ep ranks are borrowed from dp_shard × cp × tp and multiply nothing."""
    if ep == 1:
        return ""
    rest = sizes.get("pp_size", 1) * sizes["dp_replicate_size"] * sizes["cp_size"] * sizes["tp_size"]
    shard = world // rest if world % rest == 0 else None
    fix = f" (here: dp_shard_size={shard} with expert_parallel_size={ep})" if shard else ""
    return (
        f". Note: expert_parallel_size adds no ranks in ndparallel (torchtitan's rule, not Axolotl's "
        f"ep × dp_shard = world): it is carved out of dp_shard × cp × tp, so make those cover the "
        f"world{fix}"
    )


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
    """The degrees as "a×b×…" (one pipeline stage, ``pp_size`` 1, is left out)."""
    return "×".join(str(v) for n, v in sizes.items() if n != skip and not (n == "pp_size" and v == 1))
