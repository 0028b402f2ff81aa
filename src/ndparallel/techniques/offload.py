"""Activation offloading: with activation checkpointing, each decoder layer's checkpointed input —
the hidden states its recomputation starts from, ``tokens × hidden`` per layer, what grows with
``layers × sequence`` once every layer is checkpointed — lives in host memory between the layer's
forward and its backward.

Mechanism (torch's ``saved_tensors_hooks``, as torchtune's ``OffloadActivations`` and transformers'
``activation_checkpointing_enable(offload=True)``): the checkpoint function transformers calls for
each ``GradientCheckpointingLayer`` (its ``_gradient_checkpointing_func``) is wrapped so that the
checkpoint saves its inputs under our hooks; inside the checkpointed region torch's own hooks take
over, so exactly the layer inputs are offloaded — not the loss's tensors, not the LM head's.
Unlike ``save_on_cpu`` (synchronous copies on the compute stream) the copies run on a side stream
and the way back is prefetched one layer ahead:

* **forward** (pack): the side stream waits for the compute stream (the hidden states are
  complete), copies them into pinned host memory, and the device tensor is ``record_stream``-ed
  on the side stream, so its memory is not reused before the copy has read it. At most
  ``max_in_flight`` copies are outstanding: beyond that the compute stream waits for the oldest
  (bounded device memory while the host catches up).
* **backward** (unpack, when the checkpoint recomputes layer i): layer i's input is the one
  prefetched while layer i+1 ran (else copied now); the compute stream waits for that copy's
  event, then layer i−1's input is prefetched on the side stream, overlapping layer i's
  recomputation and backward. A prefetched tensor is allocated from the compute stream's pool
  after the side stream waited for the compute stream (the block's earlier users are done) and is
  ``record_stream``-ed on the side stream (dropped unused, its memory still waits for the copy).
  Pinned host buffers come from torch's caching host allocator, which records every
  non-blocking copy's event and reuses a block only after it.
* **lifetime**: the host copy belongs to the saved tensor's handle, which autograd frees with the
  layer's graph; a second unpack (``retain_graph``) copies it again.
* **bounded host memory**: at most ``max_host_bytes`` (default: 80 % of the host's available
  memory divided by the local ranks, read when the offloader is built) are held at once; layer
  inputs beyond that stay on the device (counted in ``stats.kept_on_device``, warned once).

On a CPU device the same code runs with plain copies (``HostTransfers``): tests check exactness
and the bookkeeping; ``tests/test_offload_streams.py`` replays the CUDA protocol with simulated
asynchronous streams (copies land only when their event is waited on).
"""

from __future__ import annotations

import collections
import os
import warnings
import weakref
from dataclasses import dataclass

import torch
from torch.autograd.graph import saved_tensors_hooks

from ndparallel.models.layers import outer_decoder_layers
from ndparallel.runtime.memory_probe import host_allocations


@dataclass
class OffloadStats:
    offloaded: int = 0
    offloaded_bytes: int = 0
    restored: int = 0
    prefetched: int = 0
    kept_on_device: int = 0
    host_bytes: int = 0
    """Host bytes held now."""
    peak_host_bytes: int = 0


class HostTransfers:
    """Copies without streams: a CPU device. Each way is a copy into a separate tensor, as on a
    GPU: the host copy (made inside ``host_allocations``: what a GPU keeps in pinned host memory,
    so ``memory_probe.LiveBytes`` counts it apart from the device's bytes) and, in backward, a
    fresh "device" tensor beside it (a GPU allocates one from its own pool)."""

    device_type = "cpu"

    def to_host(self, x: torch.Tensor):
        with host_allocations():
            return x.detach().clone(memory_format=torch.contiguous_format), None

    def to_device(self, host: torch.Tensor, device: torch.device):
        return host.to(device, copy=True), None

    def wait(self, event) -> None:
        pass


class CudaTransfers:
    """Copies on one side stream per device; see the module doc for the ordering rules."""

    device_type = "cuda"

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.side = torch.cuda.Stream(self.device)

    def _compute(self):
        return torch.cuda.current_stream(self.device)  # the live stream, never a cached one

    def to_host(self, x: torch.Tensor):
        self.side.wait_stream(self._compute())  # x is complete
        host = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
        with torch.cuda.stream(self.side):
            host.copy_(x, non_blocking=True)
        x.record_stream(self.side)  # x's memory is not reused before the copy has read it
        return host, self.side.record_event()

    def to_device(self, host: torch.Tensor, device: torch.device):
        dev = torch.empty(host.shape, dtype=host.dtype, device=device)  # the compute stream's pool
        self.side.wait_stream(self._compute())  # earlier users of dev's memory are done
        with torch.cuda.stream(self.side):
            dev.copy_(host, non_blocking=True)
        dev.record_stream(self.side)  # dropped unused, its memory still waits for the copy
        return dev, self.side.record_event()

    def wait(self, event) -> None:
        if event is not None:
            self._compute().wait_event(event)


class _Offloaded:
    """A saved layer input living in host memory (what autograd keeps instead of the tensor)."""

    __slots__ = ("seq", "host", "device", "pending", "__weakref__")

    def __init__(self, seq: int, host: torch.Tensor, device: torch.device):
        self.seq, self.host, self.device, self.pending = seq, host, device, None


def default_host_budget() -> int | None:
    """80 % of the host's available memory divided by this node's ranks (None if unknown)."""
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f)
        available = int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return None
    return int(0.8 * available) // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))


class ActivationOffloader:
    """Saved-tensor hooks that keep large device tensors in host memory; ``wrap`` puts them around a
    checkpoint function so that only the checkpoint's inputs are offloaded."""

    def __init__(
        self,
        transfers=None,
        min_bytes: int = 1024,
        max_in_flight: int = 2,
        prefetch: bool = True,
        max_host_bytes: int | None = None,
    ):
        self.transfers = transfers or HostTransfers()
        self.min_bytes, self.max_in_flight, self.prefetch = min_bytes, max(1, max_in_flight), prefetch
        self.max_host_bytes = max_host_bytes
        self.stats = OffloadStats()
        self._seq = 0
        self._by_seq: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
        self._in_flight: collections.deque = collections.deque()
        self._warned = False

    # ------------------------------------------------------------------ hooks
    def hooks(self) -> saved_tensors_hooks:
        return saved_tensors_hooks(self._pack, self._unpack)

    def wrap(self, checkpoint_fn) -> OffloadedCheckpoint:
        return OffloadedCheckpoint(self, checkpoint_fn)

    def _eligible(self, x: torch.Tensor) -> bool:
        return (
            type(x) is torch.Tensor
            and x.is_floating_point()
            and x.numel() * x.element_size() >= self.min_bytes
            and x.device.type == self.transfers.device_type
        )

    def _pack(self, x: torch.Tensor):
        if not self._eligible(x):
            return x
        nbytes = x.numel() * x.element_size()
        if self.max_host_bytes is not None and self.stats.host_bytes + nbytes > self.max_host_bytes:
            self.stats.kept_on_device += 1
            self._warn_budget()
            return x
        host, event = self.transfers.to_host(x)
        self._in_flight.append(event)
        while len(self._in_flight) > self.max_in_flight:
            self.transfers.wait(self._in_flight.popleft())
        self._seq += 1
        handle = _Offloaded(self._seq, host, x.device)
        self._by_seq[self._seq] = handle
        self._account(handle, nbytes)
        return handle

    def _account(self, handle: _Offloaded, nbytes: int) -> None:
        s = self.stats
        s.offloaded += 1
        s.offloaded_bytes += nbytes
        s.host_bytes += nbytes
        s.peak_host_bytes = max(s.peak_host_bytes, s.host_bytes)
        weakref.finalize(handle, _release, s, nbytes)

    def _unpack(self, packed):
        if not isinstance(packed, _Offloaded):
            return packed
        self._in_flight.clear()  # backward has started; safety never relied on these waits
        if packed.pending is not None:
            dev, event = packed.pending
            packed.pending = None
        else:
            dev, event = self.transfers.to_device(packed.host, packed.device)
        self.transfers.wait(event)
        self.stats.restored += 1
        previous = self._by_seq.get(packed.seq - 1) if self.prefetch else None
        if previous is not None and previous.pending is None:
            previous.pending = self.transfers.to_device(previous.host, previous.device)
            self.stats.prefetched += 1
        return dev

    def _warn_budget(self) -> None:
        if not self._warned:
            self._warned = True
            warnings.warn(
                f"activation_offloading: the host-memory budget of {self.max_host_bytes / 2**30:.1f} "
                "GiB is reached; further layer inputs stay on the device",
                stacklevel=3,
            )


def _release(stats: OffloadStats, nbytes: int) -> None:
    stats.host_bytes -= nbytes


class OffloadedCheckpoint:
    """A checkpoint function (``torch.utils.checkpoint.checkpoint``-like) whose saved inputs go
    through ``offloader``'s hooks; what transformers calls as ``_gradient_checkpointing_func``."""

    def __init__(self, offloader: ActivationOffloader, checkpoint_fn):
        self.offloader, self.checkpoint_fn = offloader, checkpoint_fn

    def __call__(self, function, *args, **kwargs):
        with self.offloader.hooks():
            return self.checkpoint_fn(function, *args, **kwargs)


def transfers_for(device: torch.device):
    return CudaTransfers(device) if torch.device(device).type == "cuda" else HostTransfers()


def apply_activation_offloading(model, device, layer_classes=None, **kwargs) -> ActivationOffloader:
    """Offload the checkpointed input of every decoder layer of ``model`` (activation checkpointing
    must be on: transformers' ``GradientCheckpointingLayer`` with its checkpoint function)."""

    kwargs.setdefault("max_host_bytes", default_host_budget())
    offloader = ActivationOffloader(transfers_for(device), **kwargs)
    for layer in outer_decoder_layers(model, layer_classes):
        fn = getattr(layer, "_gradient_checkpointing_func", None)
        if not getattr(layer, "gradient_checkpointing", False) or fn is None:
            raise ValueError(
                f"activation_offloading needs activation checkpointing of {type(layer).__name__} "
                "(transformers' GradientCheckpointingLayer): set fsdp_config.activation_checkpointing: "
                "true (FSDPOptions(activation_checkpointing=True))"
            )
        if not isinstance(fn, OffloadedCheckpoint):
            layer._gradient_checkpointing_func = offloader.wrap(fn)
    return offloader


def offloader_of(model) -> ActivationOffloader | None:
    """The offloader ``apply_activation_offloading`` installed on ``model`` (None if none)."""
    for module in model.modules():
        fn = getattr(module, "_gradient_checkpointing_func", None)
        if isinstance(fn, OffloadedCheckpoint):
            return fn.offloader
    return None
