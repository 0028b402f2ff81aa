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

**Selective checkpointing** (``techniques/selective_ac.py``) keeps much more than a layer's input: the
hooks are entered around each decoder layer's whole forward instead (``apply_activation_offloading(
selective=True)``), so every tensor the layer saves goes out (under sequence parallel the blocks'
shards too: ``parallel/tp/sp_saves.py`` stores them through these hooks), except what the selective
policy caches itself. What moves is a **storage**: the saved tensors that view it (``x.view(-1, h)``
saved by q, k and v's projections, RoPE's cos and sin saved by every layer) share one host copy per
forward and one device copy in backward; parameters and their views (a matmul's ``weight.t()``)
stay. Backward prefetches only within one forward's saves: under a pipeline schedule another
forward's may wait long.

On a CPU device the same code runs with plain copies (``HostTransfers``): tests check exactness
and the bookkeeping; ``tests/test_offload_streams.py`` replays the CUDA protocol with simulated
asynchronous streams (copies land only when their event is waited on).
"""

from __future__ import annotations

import collections
import contextlib
import os
import warnings
import weakref
from dataclasses import dataclass

import torch
from torch import nn
from torch.autograd.graph import saved_tensors_hooks
from torch.distributed.tensor import DTensor

from ndparallel.models.layers import outer_decoder_layers
from ndparallel.runtime.memory_probe import host_allocations
from ndparallel.techniques.host_budget import available_host_memory, host_budget


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
    """One device storage in host memory (flat): the saved tensors that view it (``_SavedView``)
    share it, and in backward share one device copy (``cached``) until the last of them is back."""

    __slots__ = (
        "seq",
        "epoch",
        "host",
        "device",
        "pending",
        "cached",
        "views",
        "left",
        "back",
        "__weakref__",
    )

    def __init__(self, seq: int, epoch: int, host: torch.Tensor, device: torch.device):
        self.seq, self.epoch, self.host, self.device = seq, epoch, host, device
        self.pending = self.cached = None
        self.views = self.left = 0
        self.back = False
        """Every view has been unpacked once: never prefetched again (a copy nobody would use,
        held until autograd frees the storage's handles)."""


class _SavedView:
    """What autograd keeps for a saved tensor: its storage's host copy and the view's geometry (a
    DTensor's local tensor, with its ``dtensor`` layout rebuilt on the way back)."""

    __slots__ = ("stored", "dtype", "size", "stride", "offset", "dtensor")

    def __init__(self, stored: _Offloaded, local: torch.Tensor, dtensor=None):
        self.stored, self.dtype, self.dtensor = stored, local.dtype, dtensor
        self.size, self.stride, self.offset = tuple(local.shape), local.stride(), local.storage_offset()
        stored.views += 1
        stored.left += 1

    def restored(self, flat: torch.Tensor) -> torch.Tensor:
        if flat.dtype != self.dtype:  # a view of the storage as another dtype
            flat = flat.view(torch.uint8).view(self.dtype)
        local = flat.as_strided(self.size, self.stride, self.offset)
        if self.dtensor is None:
            return local
        mesh, placements, shape, stride = self.dtensor
        return DTensor.from_local(local, mesh, placements, run_check=False, shape=shape, stride=stride)


def _whole_storage(local: torch.Tensor) -> torch.Tensor:
    """The whole storage ``local`` views, as a flat tensor of its dtype (no copy)."""
    n = local.untyped_storage().nbytes() // local.element_size()
    flat = torch.empty(0, dtype=local.dtype, device=local.device)
    return flat.set_(local.untyped_storage(), 0, (n,), (1,))


def _is_weight(x: torch.Tensor) -> bool:
    """A parameter, or a view of one (``weight.t()`` that a matmul saves)."""
    return isinstance(x, nn.Parameter) or isinstance(x._base, nn.Parameter)


def default_host_budget() -> int | None:
    """This rank's budget: ``host_budget`` of this machine's available memory, shared by this
    node's ranks (``LOCAL_WORLD_SIZE``)."""
    return host_budget(int(os.environ.get("LOCAL_WORLD_SIZE", "1")), available_host_memory())


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
        self._epoch = 0
        self._this_forward: dict[int, tuple] = {}
        """storage address -> weak refs to (the storage, its host copy) of what this forward
        offloaded: a storage saved again (the input of q, k and v's projections; RoPE's cos and sin,
        saved by every layer; a DTensor's local view of the attention output) goes to the host once.
        No version check: aliases (a DTensor's local tensor) count versions apart, and a storage
        changed in place after autograd saved it fails backward without offloading too."""

        def pack(x):
            return self._pack(x)

        pack._ndp_chain = (self._pack, self._unpack)  # parallel/tp/sp_saves.py packs through it
        self._pack_hook = pack

    # ------------------------------------------------------------------ hooks
    def hooks(self) -> saved_tensors_hooks:
        return saved_tensors_hooks(self._pack_hook, self._unpack)

    def new_forward(self) -> None:
        """A forward of the model (or pipeline stage) begins: backward prefetches only within one
        forward's saves (another forward's, under a pipeline schedule, may wait long)."""
        self._epoch += 1
        self._this_forward.clear()

    def host_copies(self) -> list[torch.Tensor]:
        """The host copies held now (what a count of the device's bytes leaves out)."""
        return [handle.host for handle in list(self._by_seq.values())]

    def wrap(self, checkpoint_fn) -> OffloadedCheckpoint:
        return OffloadedCheckpoint(self, checkpoint_fn)

    def _eligible(self, x: torch.Tensor) -> bool:
        return (
            type(x) in (torch.Tensor, DTensor)
            and not _is_weight(x)  # weights stay (a DTensor parameter keeps its type)
            and x.is_floating_point()
            and x.device.type == self.transfers.device_type
        )

    def _pack(self, x: torch.Tensor):
        if not self._eligible(x):
            return x
        local = x._local_tensor if isinstance(x, DTensor) else x
        layout = (x.device_mesh, x.placements, x.shape, x.stride()) if isinstance(x, DTensor) else None
        storage = local.untyped_storage()
        seen = self._this_forward.get(storage.data_ptr())
        if seen is not None and seen[0]() is storage and seen[1]() is not None:
            return _SavedView(seen[1](), local, layout)  # a storage saved again: one host copy
        nbytes = storage.nbytes()
        if nbytes < self.min_bytes or nbytes % local.element_size():
            return x
        if self.max_host_bytes is not None and self.stats.host_bytes + nbytes > self.max_host_bytes:
            self.stats.kept_on_device += 1
            self._warn_budget()
            return x
        host, event = self.transfers.to_host(_whole_storage(local))
        self._in_flight.append(event)
        while len(self._in_flight) > self.max_in_flight:
            self.transfers.wait(self._in_flight.popleft())
        self._seq += 1
        stored = _Offloaded(self._seq, self._epoch, host, local.device)
        self._by_seq[self._seq] = stored
        self._this_forward[storage.data_ptr()] = (weakref.ref(storage), weakref.ref(stored))
        self._account(stored, nbytes)
        return _SavedView(stored, local, layout)

    def _account(self, stored: _Offloaded, nbytes: int) -> None:
        s = self.stats
        s.offloaded += 1
        s.offloaded_bytes += nbytes
        s.host_bytes += nbytes
        s.peak_host_bytes = max(s.peak_host_bytes, s.host_bytes)
        weakref.finalize(stored, _release, s, nbytes)

    def _unpack(self, packed):
        if not isinstance(packed, _SavedView):
            return packed
        stored = packed.stored
        if stored.cached is None:
            stored.cached = self._fetch(stored)
        flat = stored.cached
        stored.left -= 1
        if stored.left <= 0:  # every view is back: the next unpack (retain_graph) copies again
            stored.cached, stored.left, stored.back = None, stored.views, True
        return packed.restored(flat)

    def _fetch(self, stored: _Offloaded) -> torch.Tensor:
        """``stored``'s device copy (prefetched, else copied now); then the one saved before it in
        the same forward starts its way back."""
        self._in_flight.clear()  # backward has started; safety never relied on these waits
        if stored.pending is not None:
            dev, event = stored.pending
            stored.pending = None
        else:
            dev, event = self.transfers.to_device(stored.host, stored.device)
        self.transfers.wait(event)
        self.stats.restored += 1
        previous = self._by_seq.get(stored.seq - 1) if self.prefetch else None
        if (
            previous is not None
            and previous.pending is None
            and previous.cached is None
            and not previous.back  # already restored (saved tensors unpacked out of order)
            and previous.epoch == stored.epoch
        ):
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


def apply_activation_offloading(
    model, device, layer_classes=None, selective: bool = False, offloader=None, **kwargs
) -> ActivationOffloader:
    """Offload what every decoder layer of ``model`` keeps for backward; activation checkpointing
    must be on. Full checkpointing: transformers' checkpoint function of each
    ``GradientCheckpointingLayer`` is wrapped, so only the layer's checkpointed input goes to the
    host. ``selective`` (``techniques/selective_ac.py``): the hooks are entered around each layer's
    forward, so everything the layer saves does — the checkpointed norms' and MLP tail's inputs,
    the linears' inputs (under sequence parallel the block inputs' shards,
    ``parallel/tp/sp_saves.py``), q, k, v and the attention's output — except what a selective
    policy keeps itself (the output of ``down_proj``'s collective under TP) and tensors under
    ``min_bytes``. ``offloader``: one to share (its host budget and copies): a rank's pipeline stages,
    each parallelised on its own, hold one budget; else a new one from ``kwargs``."""

    if offloader is None:
        kwargs.setdefault("max_host_bytes", default_host_budget())
        offloader = ActivationOffloader(transfers_for(device), **kwargs)
    layers = outer_decoder_layers(model, layer_classes)
    if layers and getattr(layers[0], "_ndp_offloader", None) is None:  # each forward starts there
        layers[0].register_forward_pre_hook(lambda *_: offloader.new_forward())
    for layer in layers:
        if getattr(layer, "_ndp_offloader", None) is not None:
            continue
        if selective:
            _offload_around_forward(layer, offloader)
        else:
            _offload_checkpoint_inputs(layer, offloader)
        layer._ndp_offloader = offloader
    return offloader


def _offload_checkpoint_inputs(layer, offloader: ActivationOffloader) -> None:
    """transformers' checkpoint function of ``layer`` saves its inputs under ``offloader``'s hooks."""
    fn = getattr(layer, "_gradient_checkpointing_func", None)
    if not getattr(layer, "gradient_checkpointing", False) or fn is None:
        raise ValueError(
            f"activation_offloading needs activation checkpointing of {type(layer).__name__} "
            "(transformers' GradientCheckpointingLayer): set fsdp_config.activation_checkpointing: "
            "true (ActivationOptions(activation_checkpointing=True))"
        )
    layer._gradient_checkpointing_func = offloader.wrap(fn)


def _offload_around_forward(layer, offloader: ActivationOffloader) -> None:
    """``offloader``'s hooks entered for ``layer``'s forward (with grad), left after it (even if it
    raises)."""
    entered: list = []

    def enter(_mod, _args):
        hooks = offloader.hooks() if torch.is_grad_enabled() else contextlib.nullcontext()
        hooks.__enter__()
        entered.append(hooks)

    def leave(_mod, _args, _output):
        if entered:
            entered.pop().__exit__(None, None, None)

    layer.register_forward_pre_hook(enter)
    layer.register_forward_hook(leave, always_call=True)


def offloader_of(model) -> ActivationOffloader | None:
    """The offloader ``apply_activation_offloading`` installed on ``model`` (None if none)."""
    for module in model.modules():
        if getattr(module, "_ndp_offloader", None) is not None:
            return module._ndp_offloader
    return None
