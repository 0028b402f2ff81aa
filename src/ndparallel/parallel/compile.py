"""Regional compilation: ``torch.compile`` each decoder layer in place (torchtitan's and torchtune's
way). Applied after TP, CP and activation checkpointing and before FSDP, so

* every layer shares one compiled graph (same code, parameters are graph inputs), compiled once;
* ``nn.Module.compile`` keeps the module tree and parameter names (checkpoints, export unchanged);
* FSDP2's hooks run outside the graph (dynamo skips them: ``skip_fsdp_hooks``), TP's DTensor ops
  are traced into it, and activation checkpointing (transformers' per-layer wrapper, outside
  ``_call_impl``) recomputes the compiled layer;
* the CP attention (an autograd function that sends K/V around the ring) is excluded from tracing:
  ``torch._dynamo.disable`` makes it the layer's one graph break (see ``cp_attention_eager``).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from ndparallel.models.layers import decoder_layers
from ndparallel.parallel.options import CompileOptions


def apply_compile(model: nn.Module, options: CompileOptions, layer_classes=None) -> nn.Module:
    """Compile every decoder layer of ``model`` in place with ``options``; return the model."""
    for layer in decoder_layers(model, layer_classes):
        layer.compile(backend=options.backend, fullgraph=options.fullgraph)
    return model


def eager_under_compile(fn):
    """``fn`` run eagerly when called from compiled code (a graph break around it)."""
    return torch._dynamo.disable(fn, recursive=True)
