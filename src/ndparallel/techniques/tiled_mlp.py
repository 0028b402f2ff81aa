"""Sequence-tiled MLP: each decoder layer's feed-forward block computed over tiles of the sequence,
so its ``tokens × intermediate`` activations (gate, up, their product and their gradients) never
exist whole — only one tile's (ALST, arXiv 2506.13996; Axolotl's ``tiled_mlp``).

The forward runs the tiles without autograd and keeps only the block's input; the backward
recomputes one tile at a time with autograd and back-propagates it at once (a nested
``torch.autograd.backward``): the tile's input gradient is written into the whole input's, the
parameters' gradients accumulate in their ``.grad`` tile after tile. The MLP is pointwise in the
tokens, so this is exact: the same sums, split over tiles (in fp32 equal to rounding; in bf16 the
weight gradient is summed over tiles in bf16, one rounding per tile, as ``AccumulateGrad`` does).

How it is applied, without touching the model's code: ``apply_tiled_mlp`` swaps each MLP
instance's class for a subclass whose ``__call__`` splits the call into tiles (the way FSDP2's
``fully_shard`` swaps a module's class; parameter names, the module tree and checkpoints are
unchanged). Each tile goes through the block's full ``nn.Module.__call__``, so the hooks on the
block run per tile:

* **TP**: the block's input hook turns the tile into a ``Replicate`` DTensor (all-gathering it
  over tp under sequence parallel) and ``down_proj`` all-reduces (or reduce-scatters) the tile's
  output: the same bytes as untiled, in as many calls as tiles. Every tp rank holds the same
  local length, so all cut the same tiles and call the same collectives.
* **FSDP2** shards the decoder layer, not the MLP: the layer's parameters are gathered once by its
  pre-forward / pre-backward hooks and stay gathered while the tiles run (no per-tile all-gather;
  ``tests/test_long_context.py`` counts them). An MLP that is its own FSDP unit would be gathered
  per tile: ``check_not_fsdp_unit`` refuses it.
* **Activation checkpointing** recomputes the layer, the tiled forward included (the block's
  input is all it saved), then the tiled backward recomputes each tile once more: with
  checkpointing the MLP forward runs three times, without it twice.
* **compile**: the block's own ``_call_impl`` (one tile) is what ``nn.Module.compile`` compiles;
  the tiling and the nested backward stay eager (``techniques/compile.py`` compiles the children of
  each layer when tiling is on).
* **LoRA** (PEFT linears inside the block): only the adapters' ``.grad`` accumulate.
"""

from __future__ import annotations

import functools

import torch
import torch.nn as nn

from ndparallel.models.layers import dense_mlps
from ndparallel.techniques.tile_rule import tile_spans

TILE_DIM = -2
"""The sequence dim of an MLP input ``[batch, seq, hidden]``."""


class _TiledCall(torch.autograd.Function):
    """``call`` (one tile of the block) applied tile by tile to ``x``; see the module doc."""

    @staticmethod
    def forward(ctx, call, x, spans):
        ctx.call, ctx.spans = call, spans
        ctx.save_for_backward(x)
        with torch.no_grad():
            return _run_tiles(call, x, spans)

    @staticmethod
    def backward(ctx, grad_out):
        (x,) = ctx.saved_tensors
        want_x = ctx.needs_input_grad[1]
        grad_x = torch.empty_like(x) if want_x else None
        grad_out = grad_out.contiguous()
        for start, length in ctx.spans:
            tile = x.narrow(TILE_DIM, start, length).detach().requires_grad_(want_x)
            with torch.enable_grad():
                out = ctx.call(tile)
            if out.requires_grad:
                torch.autograd.backward(out, grad_out.narrow(TILE_DIM, start, length))
            if want_x:
                if tile.grad is None:
                    grad_x.narrow(TILE_DIM, start, length).zero_()
                else:
                    grad_x.narrow(TILE_DIM, start, length).copy_(tile.grad)
        return None, grad_x, None


def _run_tiles(call, x: torch.Tensor, spans) -> torch.Tensor:
    """The block's output, written tile by tile into one tensor."""
    out = None
    for start, length in spans:
        y = call(x.narrow(TILE_DIM, start, length))
        if not isinstance(y, torch.Tensor) or y.shape[:-1] != x.narrow(TILE_DIM, start, length).shape[:-1]:
            raise TypeError(
                f"tiled_mlp: the block returned {type(y).__name__} "
                f"{tuple(getattr(y, 'shape', ()))} for a tile of shape {tuple(x.shape)}; it "
                "supports MLPs mapping [batch, seq, hidden] to one tensor per token"
            )
        if out is None:
            out = y.new_empty((*x.shape[:-1], y.shape[-1]))
        out.narrow(TILE_DIM, start, length).copy_(y)
    return out


class TiledMLPMixin:
    """Mixed into an MLP instance's class by ``apply_tiled_mlp``: calls run over sequence tiles."""

    _ndp_num_tiles: int | None = None

    def __call__(self, *args, **kwargs):
        if len(args) != 1 or kwargs or not isinstance(args[0], torch.Tensor):
            raise TypeError(
                f"tiled_mlp: {type(self).__name__} was called with {len(args)} positional and "
                f"{sorted(kwargs)} keyword arguments; it supports MLPs called with the hidden "
                "states alone"
            )
        x = args[0]
        if x.dim() < 2:
            return nn.Module.__call__(self, x)
        length = x.shape[TILE_DIM]
        spans = tile_spans(length, x.shape[-1], self._ndp_num_tiles)
        call = functools.partial(nn.Module.__call__, self)
        if len(spans) == 1:
            return call(x)
        if not torch.is_grad_enabled():
            return _run_tiles(call, x, spans)
        return _TiledCall.apply(call, x, spans)


@functools.cache
def _tiled_class(cls: type) -> type:
    return type(f"Tiled{cls.__name__}", (TiledMLPMixin, cls), {})


def tile_mlp(mlp: nn.Module, num_tiles: int | None = None) -> nn.Module:
    """Make ``mlp`` (one block, in place) run over sequence tiles; idempotent."""
    if num_tiles is not None and num_tiles < 1:
        raise ValueError(f"tiled_mlp_num_shards={num_tiles} must be >= 1")
    if not isinstance(mlp, TiledMLPMixin):
        mlp.__class__ = _tiled_class(type(mlp))
    mlp._ndp_num_tiles = num_tiles
    return mlp


def is_tiled(module: nn.Module) -> bool:
    return isinstance(module, TiledMLPMixin)


def apply_tiled_mlp(model: nn.Module, num_tiles: int | None = None, layer_classes=None) -> list[nn.Module]:
    """Tile the dense MLP of every decoder layer of ``model``; returns the blocks."""

    return [tile_mlp(mlp, num_tiles) for mlp in dense_mlps(model, layer_classes)]


def check_not_fsdp_unit(model: nn.Module) -> None:
    """A tiled MLP that is its own FSDP unit would gather its parameters once per tile: refuse."""
    from torch.distributed.fsdp import FSDPModule

    for name, module in model.named_modules():
        if is_tiled(module) and isinstance(module, FSDPModule):
            raise ValueError(
                f"tiled_mlp: {name} is its own FSDP unit (fsdp_config.layer_classes), so its "
                "parameters would be gathered once per tile; shard whole decoder layers "
                "(the default layer_classes) or turn tiled_mlp off"
            )
