"""Process-group start-up: device and backend choice, finite timeouts, NCCL fault reporting,
single-process fallback.

Every group of the job gets the same collective timeout: the default group here, every group of
the mesh through ``ParallelismConfig.build_device_mesh(timeout_s=...)``. On CUDA, NCCL's
asynchronous error handling and its flight recorder (a dump of the last collectives of every
rank when one times out) are switched on unless the environment already sets them.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ndparallel.runtime.lifeline import die_with_launcher

DEFAULT_TIMEOUT_S = 600.0
"""A dead peer makes every rank fail after this long instead of hanging forever."""

NCCL_ENV_DEFAULTS = {
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3",  # a timed-out collective ends the process, not a hang
    "TORCH_FR_BUFFER_SIZE": "2000",  # flight recorder: the last 2000 collectives per rank
    "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",  # ...written to TORCH_FR_DUMP_TEMP_FILE<rank> on a timeout
}
"""Environment torch's NCCL backend reads at group creation; values a user set are kept."""


@dataclass(frozen=True)
class DistributedInfo:
    """Where this process sits: rank, world, local rank, device, backend and collective timeout."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str
    timeout_s: float = DEFAULT_TIMEOUT_S

    @property
    def device_type(self) -> str:
        return self.device.type


def default_device_type() -> str:
    """``NDPARALLEL_DEVICE`` if set (``cpu``/``cuda``), else ``cuda`` when a GPU is visible, else ``cpu``."""
    return os.environ.get("NDPARALLEL_DEVICE") or ("cuda" if torch.cuda.is_available() else "cpu")


def backend_for(device_type: str) -> str:
    """NCCL for CUDA tensors with gloo beside it for CPU objects (DCP, metadata); gloo on CPU."""
    if device_type == "cuda":
        return "cpu:gloo,cuda:nccl"
    if device_type == "cpu":
        return "gloo"
    raise ValueError(f"device {device_type!r} is not supported: use 'cuda' or 'cpu'")


def init_distributed(device_type: str | None = None, timeout_s: float | None = None) -> DistributedInfo:
    """Join (or start) the default process group and return this rank's ``DistributedInfo``.

    Under ``torchrun`` / ``ndparallel launch`` the ``RANK``/``WORLD_SIZE`` env vars are used (and
    this process is tied to its launcher: it is killed when the launcher dies); a plain
    ``python script.py`` gets a one-rank group so every code path is the same. When a default group
    already exists it is reused and the device follows its backend (a gloo-only group means CPU;
    asking for ``cuda`` on it is an error), so repeated calls agree with the running group.
    """

    die_with_launcher()  # under an elastic agent: never outlive it (a kill -9 of the launcher)
    if timeout_s is None:
        timeout_s = float(os.environ.get("NDPARALLEL_TIMEOUT", DEFAULT_TIMEOUT_S))
    if timeout_s <= 0:
        raise ValueError(f"collective timeout must be > 0 seconds, got {timeout_s}")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if dist.is_initialized():
        device_type = _device_of_running_group(device_type)
    else:
        device_type = device_type or default_device_type()
    device = _select_device(device_type, local_rank)
    backend = backend_for(device_type)
    if not dist.is_initialized():
        _start_group(backend, device, datetime.timedelta(seconds=timeout_s))
    return DistributedInfo(
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        local_rank=local_rank,
        device=device,
        backend=dist.get_backend(),
        timeout_s=timeout_s,
    )


def _device_of_running_group(requested: str | None) -> str:
    running = str(dist.get_backend())
    if running == "fake":  # a simulated rank (runtime/fake_world.py): any device
        return requested or default_device_type()
    has_nccl = "nccl" in running
    if requested == "cuda" and not has_nccl:
        raise RuntimeError(
            f"device 'cuda' requested but the running process group uses {running!r} (CPU only): "
            "start it with NCCL (or let ndparallel start it), or use device 'cpu'"
        )
    return requested or ("cuda" if has_nccl else "cpu")


def _select_device(device_type: str, local_rank: int) -> torch.device:
    if device_type != "cuda":
        return torch.device(device_type)
    if not torch.cuda.is_available():
        raise RuntimeError("device 'cuda' requested but no GPU is visible; use device 'cpu'")
    if local_rank >= torch.cuda.device_count():
        raise RuntimeError(
            f"local rank {local_rank} has no GPU: this node shows {torch.cuda.device_count()} "
            "(launch at most that many ranks per node, or check CUDA_VISIBLE_DEVICES)"
        )
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


def _start_group(backend: str, device: torch.device, timeout: datetime.timedelta) -> None:
    kwargs = {}
    if device.type == "cuda":
        for key, value in NCCL_ENV_DEFAULTS.items():
            os.environ.setdefault(key, value)
        if os.environ.get("NDPARALLEL_EAGER_NCCL_INIT", "1") != "0":
            kwargs["device_id"] = device  # eager NCCL communicator: errors at start-up, not later
    if _restarted_under_elastic_agent():
        _init_restarted_attempt(backend, timeout, **kwargs)
    elif "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        dist.init_process_group(backend=backend, timeout=timeout, **kwargs)
    else:
        dist.init_process_group(
            backend=backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout, **kwargs
        )


def _restarted_under_elastic_agent() -> bool:
    return (
        os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        and int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
    )


def _init_restarted_attempt(backend: str, timeout: datetime.timedelta, **kwargs) -> None:
    """After ``--max-restarts`` restarts a job, the elastic agent's store still holds the previous
    attempt's gloo/NCCL addresses; a rank that starts before its peers would read the dead ones
    ("Connection refused"). Keys of each attempt get their own prefix."""
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timeout
    )
    attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]
    dist.init_process_group(
        backend=backend,
        store=dist.PrefixStore(f"ndparallel/attempt_{attempt}", store),
        rank=int(os.environ["RANK"]),
        world_size=int(os.environ["WORLD_SIZE"]),
        timeout=timeout,
        **kwargs,
    )


def rank0_decides(fn, *args, group=None, **kwargs):
    """Run ``fn`` on rank 0 only and give its result to every rank (``broadcast_object_list``):
    for decisions that must agree across ranks and would cost I/O × world if every rank made them
    (which checkpoint to resume, whether one is intact). A ``ValueError`` raised on rank 0 is raised
    on every rank with the same message. Collective when a multi-rank group is up."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1 or str(dist.get_backend()) == "fake":
        return fn(*args, **kwargs)  # (a simulated rank decides alone: a fake broadcast carries nothing)
    box: list = [None]
    if dist.get_rank(group) == 0:
        try:
            box[0] = ("ok", fn(*args, **kwargs))
        except ValueError as e:
            box[0] = ("error", str(e))
    dist.broadcast_object_list(box, group_src=0, group=group)
    status, value = box[0]
    if status == "error":
        raise ValueError(value)
    return value


def long_wait_group(hours: float = 24.0):
    """A gloo group over all ranks with a long timeout, for waits that are not collectives of the
    training step (a hub download by one rank per node, a slow filesystem): a barrier on it does
    not trip the job's short collective timeout. Collective: every rank must call it."""
    return dist.new_group(backend="gloo", timeout=datetime.timedelta(hours=hours))


def shutdown() -> None:
    """Destroy the default process group if one exists."""
    if dist.is_initialized():
        dist.destroy_process_group()
