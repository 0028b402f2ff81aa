"""Tensor parallelism of LoRA-wrapped linears: A and B sharded consistently with the base linear.

PEFT replaces ``q_proj`` by a ``lora.Linear`` computing ``base_layer(x) + s · B(A(dropout(x)))``.
``LoraParallel`` shards it like the plan's style for ``q_proj``:

* column-wise base (``W`` split on out): ``A`` replicated, ``B`` column-wise. ``x`` is the base's
  replicated input, so ``A(x)`` needs nothing; ``B`` writes the same output columns as the base.
* row-wise base (``W`` split on in): ``A`` row-wise, ``B`` replicated. ``A(x_local)`` is a partial
  sum like the base's output; ``B`` is linear, so ``B(A(x))`` stays partial, and the base and
  adapter partial sums are added *before* the one reduction (all-reduce, or reduce-scatter under
  sequence parallel) the base layer needs anyway.

Activations therefore cross ranks exactly where the base layer's do; the forward pass has no
extra collective. In backward the replicated factor's gradient is a sum over the tp ranks (one
all-reduce of its r·d elements per adapted linear, like a replicated norm weight under sequence
parallel; FSDP2 does it as part of its gradient reduction). Counted in ``tests/test_lora_tp.py``.

The block's input and output layouts are kept: the wrapper's pre-hook makes ``x`` the DTensor the
base style wants, its post-hook turns the summed output into the base style's output layout.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    parallelize_module,
)

from ndparallel.models.tp_plans import TPPlanError
from ndparallel.parallel.tp.styles import replicate_param


def _replicate_params(module: nn.Module, mesh: DeviceMesh) -> None:
    """Parameters → ``Replicate`` DTensors, no hooks (the module gets DTensor inputs)."""
    for name, param in list(module.named_parameters(recurse=False)):
        module.register_parameter(name, replicate_param(param, mesh))


class LoraParallel(ParallelStyle):
    """Shard a PEFT ``lora.Linear`` as ``base`` (a ``ColwiseParallel`` / ``RowwiseParallel``)
    shards a plain linear, with its input and output layouts; see the module doc."""

    def __init__(self, base: ParallelStyle, name: str = "") -> None:
        super().__init__()
        if not isinstance(base, (ColwiseParallel, RowwiseParallel)):
            raise TPPlanError(
                f"LoRA on {name!r} with tensor parallel needs a column- or row-wise linear there, "
                f"its tp style is {type(base).__name__}: leave it out of lora_target_modules"
            )
        self.colwise = isinstance(base, ColwiseParallel)
        self.input_layout = base.input_layouts[0]
        self.output_layout = base.output_layouts[0]
        self.use_local_output = base.use_local_output
        self.name = name

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not isinstance(module.base_layer, nn.Linear) or module.lora_embedding_A:
            raise TPPlanError(
                f"LoRA on {self.name!r} ({type(module.base_layer).__name__}) with tensor parallel is "
                "not supported (linear layers only): leave it out of lora_target_modules"
            )
        keep = dict(use_local_output=False)
        if self.colwise:
            base, a_style, b_style = ColwiseParallel(**keep), None, ColwiseParallel(**keep)
            desired = Replicate()
        else:
            part = dict(output_layouts=Partial(), **keep)
            base, a_style, b_style = RowwiseParallel(**part), RowwiseParallel(**part), None
            desired = Shard(-1)
        parallelize_module(module.base_layer, device_mesh, base)
        for children, style in ((module.lora_A, a_style), (module.lora_B, b_style)):
            for child in children.values():
                if style is None:
                    _replicate_params(child, device_mesh)
                else:
                    parallelize_module(child, device_mesh, style)
        module.register_forward_pre_hook(self._input_hook(device_mesh, desired), with_kwargs=True)
        module.register_forward_hook(self._output_hook(device_mesh))
        return module

    def _input_hook(self, mesh: DeviceMesh, desired):
        layout = self.input_layout

        def hook(_mod, args, kwargs):
            x = args[0] if args else kwargs.pop("x")
            if not isinstance(x, DTensor):
                x = DTensor.from_local(x, mesh, [layout], run_check=False)
            if x.placements != (desired,):
                x = x.redistribute(mesh, [desired])
            return (x, *args[1:]), kwargs

        return hook

    def _output_hook(self, mesh: DeviceMesh):
        layout, local = self.output_layout, self.use_local_output

        def hook(_mod, _args, out: torch.Tensor):
            if out.placements != (layout,):
                out = out.redistribute(mesh, [layout])
            return out.to_local() if local else out

        return hook
