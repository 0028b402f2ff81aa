"""``ParallelModel``: what the engine knows of one model it parallelised, one typed record per model
(instead of a side table per fact), kept by the engine under the model it returned."""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch.nn as nn

from ndparallel.models.adapters import base_model_of
from ndparallel.models.moe import moe_spec

if TYPE_CHECKING:
    from ndparallel.models.moe import MoESpec
    from ndparallel.parallel.pp.schedule import Pipeline


def router_loss_spec(model: nn.Module) -> MoESpec | None:
    """The ``MoESpec`` of a mixture-of-experts model whose training loss includes the routers'
    load-balancing loss (transformers' ``output_router_logits``), else None."""
    spec = moe_spec(base_model_of(model))
    return spec if spec is not None and spec.aux_loss_coef is not None else None


_UNREAD = object()


@dataclass(eq=False)
class ParallelModel:
    """One model the engine returned: a parallelised model, or under pipeline parallel the
    ``StageView`` of this rank's stages (each stage has its own record)."""

    module_ref: weakref.ref
    """The model (weakly: the engine's table is keyed by it and must not keep it alive)."""
    loss_parallel: bool = False
    """The option ``loss_parallel`` resolved for this model (TP on, the LM head sharded
    column-wise): its logits are vocab-sharded and the loss runs in torch's ``loss_parallel()``."""
    pipeline: Pipeline | None = None
    """The pipeline running this rank's stages (a ``StageView`` only)."""
    _router_spec: object = field(default=_UNREAD, repr=False)

    @property
    def module(self) -> nn.Module | None:
        return self.module_ref()

    @classmethod
    def of(cls, model: nn.Module, **fields) -> ParallelModel:
        return cls(weakref.ref(model), **fields)

    def router_spec(self) -> MoESpec | None:
        """The model's ``router_loss_spec``, read from it on first use (a forward with the loss)."""
        if self._router_spec is _UNREAD:
            self._router_spec = router_loss_spec(self.module)
        return self._router_spec
