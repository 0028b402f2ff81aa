"""Regional compilation: ``torch.compile`` each decoder layer in place (torchtitan's and torchtune's
way). Applied after TP, CP and activation checkpointing and before FSDP, so

* every layer shares one compiled graph (same code, parameters are graph inputs), compiled once;
* ``nn.Module.compile`` keeps the module tree and parameter names (checkpoints, export unchanged);
* FSDP2's hooks run outside the graph (dynamo skips them: ``skip_fsdp_hooks``), TP's DTensor ops
  are traced into it, and activation checkpointing (transformers' per-layer wrapper, outside
  ``_call_impl``) recomputes the compiled layer;
* the CP attention (an autograd function that sends K/V around the ring over a process group
  dynamo cannot trace) and the document attention of TP + sequence parallel (its masks are built
  on the host from the positions) run eagerly: a graph break before and after, the rest compiled.

Under tensor parallelism the unit is each child of a decoder layer (attention, MLP, norms) rather
than the layer: with the whole layer compiled, the backward of torch 2.13's compiled graph hands
a plain tensor to a DTensor redistribute (``'Tensor' object has no attribute '_local_tensor'``);
compiling the attention and the MLP of each layer is exact (``tests/test_compile.py``); the norms
(replicated DTensor weights) and residual adds stay eager there, as compiled norms lose their
weight gradients' sum over tp.

CP with activation checkpointing: the non-reentrant checkpoint runs the layer under saved-tensor
hooks, and dynamo cannot break a graph there: a layer holding the (eager) CP attention would fall
back to eager as a whole (nothing compiled, seen on torch 2.13). There the unit is each child but
the attention: the MLP is compiled, the attention block runs eagerly.

TP with the tiled MLP: tracing the per-tile call of the MLP on DTensors recurses without end in
torch 2.13's AOT autograd (``RecursionError`` under ``aot_eager``, with or without the lean norms),
so there the tiled MLP runs eagerly and the attention is compiled (``eager``, set by
``parallel/parallelize.py``).

A checkpointed layer is traced as one checkpoint higher-order op, and dynamo refuses a side effect
on outside state inside it (a graph break, the layer back to eager): transformers >= 5.25's
attention classes, decorated by the ``kernels`` package, set and reset a module-level variable in
every forward. That side effect leaves no trace once the forward returns, so nothing is lost by
not replaying it in the recompute: while the model runs, dynamo's own switch for this
(``skip_fwd_side_effects_in_bwd_under_checkpoint``) is on (``_checkpoint_side_effects``) — except
around nested checkpoints (QAT's recomputed quantisers), where torch 2.13's dynamo fails with it:
there the checkpointed layers run eagerly.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn

from ndparallel.models.layers import decoder_layers
from ndparallel.techniques.qat import RecomputedQuantizer
from ndparallel.techniques.technique_options import CompileOptions


def apply_compile(
    model: nn.Module,
    options: CompileOptions,
    layer_classes=None,
    per_child: bool = False,
    skip_attention: bool = False,
    eager: Callable[[nn.Module], bool] | None = None,
) -> nn.Module:
    """Compile every decoder layer of ``model`` (or, ``per_child``, every child module of each
    layer that holds parameters, norms excepted, the attention too when ``skip_attention`` and the
    children ``eager`` picks) in place with ``options``; return the model."""
    _attention_eager(model)
    per_child = per_child or skip_attention
    layers = decoder_layers(model, layer_classes)
    if any(getattr(layer, "gradient_checkpointing", False) for layer in layers) and not _nested_checkpoints(
        model
    ):
        _checkpoint_side_effects(model)
    for layer in layers:
        units = (
            [
                c
                for n, c in layer.named_children()
                if "norm" not in n
                and any(True for _ in c.parameters())
                and not (skip_attention and _is_attention(n))
                and not (eager is not None and eager(c))
            ]
            if per_child
            else [layer]
        )
        for unit in units:
            unit.compile(backend=options.backend, fullgraph=options.fullgraph)
    return model


_SKIP_REPLAY = "skip_fwd_side_effects_in_bwd_under_checkpoint"


def _nested_checkpoints(model: nn.Module) -> bool:
    """Checkpoints inside the layer's checkpoint (QAT's ``RecomputedQuantizer``): with the switch on,
    torch 2.13's dynamo fails on them (an internal error pruning the nested graphs), so there the
    layers stay eager as before."""

    return any(isinstance(m, RecomputedQuantizer) for m in model.modules())


def _checkpoint_side_effects(model: nn.Module) -> None:
    """Turn dynamo's ``skip_fwd_side_effects_in_bwd_under_checkpoint`` on for the duration of each
    forward of ``model`` (a forward pre-hook enters the config patch, a forward hook that runs
    even when the forward raises leaves it): process-wide settings stay as they were."""
    if not hasattr(torch._dynamo.config, _SKIP_REPLAY):  # older torch: the layer stays eager
        return
    active = []

    def enter(module, args, kwargs):
        patch = torch._dynamo.config.patch(**{_SKIP_REPLAY: True})
        patch.__enter__()
        active.append(patch)

    def leave(module, args, kwargs, output):
        if active:
            active.pop().__exit__(None, None, None)

    model.register_forward_pre_hook(enter, with_kwargs=True)
    model.register_forward_hook(leave, with_kwargs=True, always_call=True)


def _is_attention(child_name: str) -> bool:
    return "attn" in child_name or "attention" in child_name


def _attention_eager(model: nn.Module) -> None:
    """Run the model's CP or document attention (an ``ndparallel_*`` name in transformers'
    ``AttentionInterface``) eagerly inside compiled layers: re-register it behind
    ``torch._dynamo.disable`` (a clean graph break; dynamo cannot trace its process group, nor
    the host-side document geometry)."""
    from transformers import AttentionInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    name = getattr(getattr(model, "config", None), "_attn_implementation", None)
    if not (isinstance(name, str) and name.startswith(("ndparallel_cp_", "ndparallel_documents_"))):
        return
    fn = ALL_ATTENTION_FUNCTIONS[name]
    if not getattr(fn, "_ndparallel_eager", False):
        eager = torch._dynamo.disable(fn, recursive=True)
        eager._ndparallel_eager = True
        AttentionInterface.register(name, eager)
