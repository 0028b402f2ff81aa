"""Sequence parallel at Megatron's activation bound: a block's gathered input saved as its shard.

Under sequence parallel each attention / MLP block all-gathers its sequence-sharded input
(``GatherSequenceInput``) and its column-wise linears (q, k, v; gate, up) save that gathered input
for their weight gradients: ``tokens × hidden`` per block, the same on every tp rank — two such
tensors per decoder layer that tensor parallelism does not divide. Megatron keeps the shard instead
and all-gathers it again in backward (Korthikanti et al., 2022, §4.2.2).

``GatherSequenceInputSavingShard`` does the same with torch's saved-tensor hooks, around the block's
forward only: a tensor saved for backward that is (a view of) the gathered input is packed as a
reference to the rank's shard plus the view's geometry; unpacking all-gathers the shard once per
block and backward (cached while any of the block's saved views still needs it) and rebuilds the
view. Every other saved tensor passes through untouched, so the arithmetic — and the result — is
exactly that of the plain block (``tests/test_tensor_parallel*.py``).

Inside an activation-checkpointed layer (or under any other saved-tensor hooks) the outer hooks
govern what is kept, and nothing is installed here: the checkpointed layer keeps only its sharded
input anyway. The selective policy (``techniques/selective_ac.py``) checkpoints the norms outside
the blocks and the MLP's tail inside it, after its gate and up saved their shards here: the blocks
keep their shards under it. Two kinds of outer hooks are the exception: hooks marked ``observing``
(a byte counter) are shown what is really kept, and a pack hook carrying ``_ndp_chain`` (activation
offloading around a selective layer, ``techniques/offload.py``) stores what is kept — every other
saved tensor, and the shard once per block — through its own pack and unpack. Under ``torch.compile``
(regional compile of the decoder layers) nothing is installed either: dynamo cannot trace
saved-tensor hooks, so a compiled layer saves the gathered input as before (one graph per layer
kept).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed._functional_collectives import all_gather_single
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ParallelStyle

from ndparallel.parallel.tp.styles import GatherSequenceInput

_SEQ_DIM = 1


def observing(pack):
    """Mark a saved-tensor pack hook as an observer (it returns its input unchanged and only looks,
    e.g. to count saved bytes): a block's shard-saving hooks then run beneath it and show it what
    is really kept (the shard, not the gathered input)."""
    pack._ndp_observer = True
    return pack


class _Outer:
    """The saved-tensor hooks active around a block's forward, as they bear on its own: ``own``
    whether it may install them (not under hooks that decide what is kept — activation
    checkpointing — nor in a forward run inside backward: the tiled MLP's recompute uses its saves
    at once), ``observer`` a byte counter to show what is kept, ``chain`` the (pack, unpack) that
    store what is kept (activation offloading)."""

    __slots__ = ("own", "observer", "chain")

    def __init__(self, own: bool, observer=None, chain=None):
        self.own, self.observer, self.chain = own, observer, chain

    @classmethod
    def now(cls) -> _Outer:
        if torch._C._current_graph_task_id() != -1:  # a recompute inside backward: used at once
            return cls(False)
        top = torch._C._autograd._top_saved_tensors_default_hooks(False)
        if top is None:
            return cls(True)
        pack = top[0]
        if getattr(pack, "_ndp_observer", False):
            return cls(True, observer=pack)
        chain = getattr(pack, "_ndp_chain", None)
        return cls(True, chain=chain) if chain is not None else cls(False)


class _GatheredInput:
    """One block forward's gathered input: the rank's shard it came from, and (in backward) the
    re-gathered tensor, shared by every saved view of it and freed with the last of them."""

    def __init__(self, shard: torch.Tensor, gathered: torch.Tensor, mesh: DeviceMesh, chain=None):
        self.shard, self.mesh, self.chain = shard, mesh, chain
        self.storage = gathered.untyped_storage().data_ptr()
        self.base_offset = gathered.storage_offset()
        self.shape = tuple(gathered.shape)
        self._full: torch.Tensor | None = None
        self._stored = None

    def keep(self) -> None:
        """A view of the gathered input is saved: the shard goes through the chain's pack once."""
        if self.chain is not None and self._stored is None:
            self._stored, self.shard = self.chain[0](self.shard), None

    def full(self) -> torch.Tensor:
        if self._full is None:
            shard = self.shard if self._stored is None else self.chain[1](self._stored)
            with torch.no_grad():
                whole = all_gather_single(shard.contiguous(), _SEQ_DIM, self.mesh.get_group())
                self._full = (whole.wait() if hasattr(whole, "wait") else whole).contiguous()
            if tuple(self._full.shape) != self.shape:  # uneven shards would need DTensor's padding
                raise RuntimeError(f"re-gathered block input {tuple(self._full.shape)} != saved {self.shape}")
        return self._full


class _SavedView:
    """What is saved for backward in place of a view of the gathered input."""

    __slots__ = ("source", "size", "stride", "offset", "dtensor")

    def __init__(self, source: _GatheredInput, local: torch.Tensor, dtensor: DTensor | None):
        self.source = source
        self.size, self.stride = tuple(local.shape), local.stride()
        self.offset = local.storage_offset() - source.base_offset
        self.dtensor = None if dtensor is None else (dtensor.placements, dtensor.shape, dtensor.stride())

    def restore(self) -> torch.Tensor:
        local = self.source.full().as_strided(self.size, self.stride, self.offset)
        if self.dtensor is None:
            return local
        placements, shape, stride = self.dtensor
        return DTensor.from_local(
            local, self.source.mesh, placements, run_check=False, shape=shape, stride=stride
        )


def _hooks(source: _GatheredInput, outer: _Outer):
    """(pack, unpack) of one block forward: views of the gathered input saved as the shard."""
    observer, chain = outer.observer, outer.chain

    def pack(t: torch.Tensor):
        local = t._local_tensor if isinstance(t, DTensor) else t
        if local.device.type == "meta" or local.untyped_storage().data_ptr() != source.storage:
            if observer is not None:
                observer(t)
            return t if chain is None else chain[0](t)
        if observer is not None:
            observer(source.shard)
        source.keep()
        return _SavedView(source, local, t if isinstance(t, DTensor) else None)

    def unpack(packed):
        if isinstance(packed, _SavedView):
            return packed.restore()
        return packed if chain is None else chain[1](packed)

    return pack, unpack


class GatherSequenceInputSavingShard(GatherSequenceInput):
    """``GatherSequenceInput`` whose gathered input is saved for backward as the rank's sequence
    shard (re-gathered in backward): what a block keeps is divided by tp like the rest."""

    def _to_replicate(self, x, mesh):
        if isinstance(x, DTensor):  # already laid out by someone else: gathered as is
            return super()._to_replicate(x, mesh)
        local = x
        shard = DTensor.from_local(local, mesh, [Shard(_SEQ_DIM)], run_check=False)
        gathered = shard.redistribute(mesh, [Replicate()])
        if torch.compiler.is_compiling():  # saved-tensor hooks would break dynamo's graph
            return gathered
        outer = _Outer.now()
        if torch.is_grad_enabled() and outer.own:
            self._pending = (_GatheredInput(local.detach(), gathered.to_local(), mesh, outer.chain), outer)
        return gathered

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        super()._apply(module, device_mesh)  # the gathering pre-hook runs first
        entered: list[torch.autograd.graph.saved_tensors_hooks] = []

        def enter(_mod, _args, _kwargs):
            if torch.compiler.is_compiling():
                return
            pending = self.__dict__.pop("_pending", None)
            if pending is not None:
                hooks = torch.autograd.graph.saved_tensors_hooks(*_hooks(*pending))
                hooks.__enter__()
                entered.append(hooks)

        def leave(_mod, _args, _output):
            if not torch.compiler.is_compiling() and entered:
                entered.pop().__exit__(None, None, None)

        module.register_forward_pre_hook(enter, with_kwargs=True)
        module.register_forward_hook(leave, always_call=True)
        return module


def sequence_parallel_block_input(save_shards: bool = True) -> ParallelStyle:
    """The block-input style under sequence parallel: shards saved (Megatron's bound, one more
    all-gather per block in backward) or the gathered input saved as is."""
    return GatherSequenceInputSavingShard() if save_shards else GatherSequenceInput()
