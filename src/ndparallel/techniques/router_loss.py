"""The routers' auxiliary load-balancing loss of a mixture-of-experts model, as transformers
computes it, and layout-invariant like the main loss.

transformers (``load_balancing_loss_func``, the same code in Qwen3-MoE, Mixtral, gpt-oss, OLMoE,
Qwen2-MoE ...) takes the router logits of every MoE layer of one forward: R rows (tokens × layers),
E experts, top-k routing, and computes

    f_e = (rows whose top-k holds e) / R,   P_e = (Σ_rows softmax(logits)_e) / R,
    aux = E · Σ_e f_e · P_e,

then adds ``router_aux_loss_coef · aux`` to the loss when ``config.output_router_logits`` is true.
f has no gradient (a count), P carries it. With an ``attention_mask`` the rows are weighted by it.

Layout invariance. One device computes ``aux`` over the whole micro-batch, i.e. over the global
micro-batch whose rows are spread over the dp × cp ranks (and over tp under sequence parallel).
Here each rank keeps the router logits of its own rows while the model runs (forward hooks on the
routers, as transformers' ``output_router_logits`` does; removed before backward, so an
activation-checkpointing recompute neither records twice nor saves other tensors than the forward
did), reduces them to per-expert statistics after the forward, then one all-reduce sums the counts, row totals
and probability sums over the ranks holding
distinct rows. Each rank adds ``E · Σ_e f_e · P_e^rank`` with ``P_e^rank`` its own probability sums
/ the global R: the ranks' terms add up to the global ``aux`` and their gradients to its gradient,
whatever the layout. The value each rank reports is the global ``aux`` / (dp × cp ranks), so the
step loss summed over them (``Engine.reduce_step_loss``) holds it once.

Gradient accumulation: the step's auxiliary loss is the mean over its micro-batches of each global
micro-batch's ``aux`` (one device accumulating the same micro-batches computes the same). Padding
positions without an ``attention_mask`` count as rows, as in transformers.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from ndparallel.models.moe import MoESpec, router_modules


@dataclass
class RouterStatistics:
    """This rank's routing statistics of one forward, summed over the MoE layers."""

    spec: MoESpec
    counts: torch.Tensor | None = None
    """(E,) float: rows whose top-k holds each expert (no gradient)."""
    prob_sums: torch.Tensor | None = None
    """(E,) fp32: summed routing probabilities (carries the gradient)."""
    rows: torch.Tensor | None = None
    layers: int = 0
    mask: torch.Tensor | None = field(default=None, repr=False)
    logits: list = field(default_factory=list, repr=False)
    """The routers' logits kept during the forward (reduced by ``reduce``)."""

    def reduce(self) -> None:
        """Turn the kept logits into the statistics (after the forward, outside any checkpoint)."""
        for logits in self.logits:
            self._add(logits)
        self.logits.clear()

    def _add(self, logits: torch.Tensor) -> None:
        """One router's logits (rows, E), as transformers' ``load_balancing_loss_func`` reads them."""
        if isinstance(logits, DTensor):
            logits = logits.to_local()
        e, k = self.spec.num_experts, self.spec.top_k
        routing = torch.nn.functional.softmax(logits, dim=-1)
        _, selected = torch.topk(routing, k, dim=-1)
        if self.mask is None:
            weight = torch.ones(routing.shape[0], dtype=torch.float32, device=routing.device)
        else:
            weight = self.mask.reshape(-1).to(routing.device, torch.float32)
            if weight.numel() != routing.shape[0]:
                raise ValueError(
                    f"attention_mask holds {weight.numel()} positions but the router saw "
                    f"{routing.shape[0]} rows: pass no attention_mask (pack with position_ids)"
                )
        counts = torch.zeros(e, dtype=torch.float32, device=routing.device).scatter_add_(
            0, selected.reshape(-1), weight.repeat_interleave(k)
        )
        probs = (routing.float() * weight.unsqueeze(-1)).sum(dim=0)
        rows = weight.sum()
        self.counts = counts if self.counts is None else self.counts + counts
        self.prob_sums = probs if self.prob_sums is None else self.prob_sums + probs
        self.rows = rows if self.rows is None else self.rows + rows
        self.layers += 1


@contextlib.contextmanager
def recording_routers(model: nn.Module, spec: MoESpec, attention_mask: torch.Tensor | None = None):
    """Record ``model``'s router statistics while the block runs (yields ``RouterStatistics``)."""
    stats = RouterStatistics(spec, mask=attention_mask)
    handles = []
    for _, module, index in router_modules(model):

        def hook(_module, _args, output, _index=index):
            stats.logits.append(output[_index] if isinstance(output, (tuple, list)) else output)

        handles.append(module.register_forward_hook(hook))
    try:
        yield stats
    finally:
        for handle in handles:
            handle.remove()


def aux_loss_term(
    stats: RouterStatistics, group: dist.ProcessGroup | None, reporting_ranks: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(this rank's term to add to its loss share, the global aux value) of one micro-batch;
    ``group``: the ranks holding distinct router rows; ``reporting_ranks``: how many ranks' loss
    shares are summed to report the step loss (dp × cp). Every rank of ``group`` must call it."""
    stats.reduce()
    if stats.layers == 0:
        raise RuntimeError("no router ran in the forward: the auxiliary loss has nothing to average")
    e = stats.spec.num_experts
    totals = torch.cat([stats.counts, stats.prob_sums.detach(), stats.rows.reshape(1)])
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(totals, group=group)
    counts, prob_sums, rows = totals[:e], totals[e : 2 * e], totals[2 * e]
    fraction = counts / rows
    local = e * (fraction * (stats.prob_sums / rows)).sum()
    value = e * (fraction * (prob_sums / rows)).sum()
    return local + (value / reporting_ranks - local).detach(), value
