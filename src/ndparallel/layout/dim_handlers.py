"""Per-dimension handlers of ``ParallelismConfig``, under Hugging Face Accelerate's names, so a
script that builds ``ParallelismConfig(cp_size=8, cp_handler=TorchContextParallelConfig(...))``
runs unchanged. They only carry choices; the Accelerator maps them onto the strategy options."""

from __future__ import annotations

import os
from dataclasses import dataclass

CP_STRATEGY_ENV = "PARALLELISM_CONFIG_CP_COMM_STRATEGY"
SEQUENCE_PARALLEL_ENV = "NDPARALLEL_SEQUENCE_PARALLEL"
# Accelerate's names -> ours. torch's "alltoall" rotate method passes each K/V shard from rank to
# rank (with all_to_all as the transport): the same computation as our ring (send/recv transport).
# (ndparallel's head-splitting all-to-all is called "ulysses" so the two never clash.)
CP_STRATEGIES = {"allgather": "allgather", "alltoall": "ring", "ring": "ring"}


@dataclass
class TorchContextParallelConfig:
    """How context-parallel attention exchanges keys and values.

    ``cp_comm_strategy``: ``"allgather"`` (K/V gathered once per layer), ``"alltoall"``
    (Accelerate's name for the rotating exchange; runs our ring) or ``"ring"``. ``None`` reads
    ``PARALLELISM_CONFIG_CP_COMM_STRATEGY`` (set by ``accelerate launch``), else shows Accelerate's
    default ``"allgather"`` but leaves the choice to ndparallel's ``CPOptions`` default (ring): the
    two compute the same attention; only their memory and latency differ (docs/context_parallel.md).
    """

    cp_comm_strategy: str | None = None

    def __post_init__(self) -> None:
        self.chosen = self.cp_comm_strategy is not None or bool(os.environ.get(CP_STRATEGY_ENV, "").strip())
        if self.cp_comm_strategy is None:
            self.cp_comm_strategy = os.environ.get(CP_STRATEGY_ENV, "").strip() or "allgather"
        if self.cp_comm_strategy not in CP_STRATEGIES:
            raise ValueError(
                f"cp_comm_strategy={self.cp_comm_strategy!r} is not one of {sorted(CP_STRATEGIES)}: "
                "use 'allgather' (K/V gathered once per layer) or 'alltoall'/'ring' (K/V rotated)"
            )

    @property
    def strategy(self) -> str:
        """Our strategy name (``CPOptions.comm_strategy``)."""
        return CP_STRATEGIES[self.cp_comm_strategy]


@dataclass
class TorchTensorParallelConfig:
    """Tensor-parallel handler. ``enable_async_tp`` (async TP, a CUDA symmetric-memory kernel
    fusion) is not implemented: asking for it is an error rather than a silent no-op.

    ``sequence_parallel`` is ndparallel's own field (Accelerate's handler has none): the norms' and
    residual stream's activations sharded on the sequence over the tp ranks (``TPOptions``; the model
    must be made tensor-parallel by ndparallel, not loaded with transformers' ``tp_plan``). ``None``
    reads ``NDPARALLEL_SEQUENCE_PARALLEL`` (1/true), else off."""

    enable_async_tp: bool = False
    sequence_parallel: bool | None = None

    def __post_init__(self) -> None:
        if self.enable_async_tp:
            raise ValueError(
                "TorchTensorParallelConfig(enable_async_tp=True) is not supported by ndparallel: "
                "leave enable_async_tp=False (TP runs with synchronous collectives)"
            )
        if self.sequence_parallel is None:
            raw = os.environ.get(SEQUENCE_PARALLEL_ENV, "").strip().lower()
            if raw not in ("", "0", "1", "false", "true"):
                raise ValueError(f"{SEQUENCE_PARALLEL_ENV}={raw!r} is not a flag: use 1/true or 0/false")
            self.sequence_parallel = raw in ("1", "true")
