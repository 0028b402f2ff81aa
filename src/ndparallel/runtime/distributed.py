"""Process-group start-up: device and backend choice, finite timeouts, single-process fallback."""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

DEFAULT_TIMEOUT_S = 600.0
"""A dead peer makes every rank fail after this long instead of hanging forever."""


@dataclass(frozen=True)
class DistributedInfo:
    """Where this process sits: rank, world, local rank, device and backend."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str

    @property
    def device_type(self) -> str:
        return self.device.type


def default_device_type() -> str:
    """``cuda`` when a GPU is visible, else ``cpu``."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def backend_for(device_type: str) -> str:
    """NCCL for CUDA tensors with gloo beside it for CPU objects (DCP, metadata); gloo on CPU."""
    if device_type == "cuda":
        return "cpu:gloo,cuda:nccl"
    if device_type == "cpu":
        return "gloo"
    raise ValueError(f"device {device_type!r} is not supported: use 'cuda' or 'cpu'")


def init_distributed(
    device_type: str | None = None, timeout_s: float | None = None
) -> DistributedInfo:
    """Join (or start) the default process group and return this rank's ``DistributedInfo``.

    Under ``torchrun`` / ``ndparallel launch`` the ``RANK``/``WORLD_SIZE`` env vars are used; a plain
    ``python script.py`` gets a one-rank group so every code path is the same. A default group that
already exists is reused as it is (its backend is not checked against ``device_type``).
    """
    device_type = device_type or os.environ.get("NDPARALLEL_DEVICE") or default_device_type()
    if timeout_s is None:
        timeout_s = float(os.environ.get("NDPARALLEL_TIMEOUT", DEFAULT_TIMEOUT_S))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device_type == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("device 'cuda' requested but no GPU is visible; use device 'cpu'")
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device(device_type)
    backend = backend_for(device_type)
    if not dist.is_initialized():
        timeout = datetime.timedelta(seconds=timeout_s)
        if _restarted_under_elastic_agent():
            _init_restarted_attempt(backend, timeout)
        elif "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            dist.init_process_group(backend=backend, timeout=timeout)
        else:
            dist.init_process_group(
                backend=backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout
            )
    return DistributedInfo(
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        local_rank=local_rank,
        device=device,
        backend=backend,
    )


def _restarted_under_elastic_agent() -> bool:
    return (os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
            and int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0)


def _init_restarted_attempt(backend: str, timeout: datetime.timedelta) -> None:
    """After ``--max-restarts`` restarts a job, the elastic agent's store still holds the previous
    attempt's gloo/NCCL addresses; a rank that starts before its peers would read the dead ones
    ("Connection refused"). Keys of each attempt get their own prefix."""
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          is_master=False, timeout=timeout)
    attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]
    dist.init_process_group(
        backend=backend, store=dist.PrefixStore(f"ndparallel/attempt_{attempt}", store),
        rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]), timeout=timeout,
    )


def shutdown() -> None:
    """Destroy the default process group if one exists."""
    if dist.is_initialized():
        dist.destroy_process_group()
