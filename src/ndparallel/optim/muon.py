"""Muon for the hidden matrices, AdamW for the rest: one optimizer, correct on sharded parameters.

Which parameter gets what, and the defaults, follow Axolotl's ``optimizer: muon`` under FSDP2
(``DistMuon`` of axolotl-contribs-mit, after microsoft/dion): every trained matrix (≥ 2-D) of the
hidden layers gets Muon, with ``weight_decay``; the token embeddings, the LM head and every 1-D
parameter (norms, biases) get AdamW without weight decay, at the same learning rate. Muon's
momentum is 0.95, not Nesterov; its update is scaled by ``sqrt(fan_out / fan_in)`` (the "spectral
norm" adjustment, so the learning rate transfers across widths); weight decay is decoupled
(``W *= 1 - lr * wd``, the unscaled lr). Expert weights (3-D, one matrix per expert) are batches of
matrices: each expert matrix is orthogonalised on its own. Axolotl's one-GPU path is another
optimizer (Moonlight's: Nesterov, ``0.2 * sqrt(max(fan_out, fan_in))``, and 1-D parameters left
untrained); here one algorithm runs on every layout, so one GPU trains what FSDP2 trains.

Newton–Schulz needs the WHOLE matrix: on FSDP2 / TP the gradients and momentum are DTensor shards,
and orthogonalising each rank's shard (what ``torch.optim.Muon`` does on local tensors) is a
different, wrong update. Here the momentum stays sharded; per matrix, the momentum-updated
gradient is redistributed to Replicate over the mesh dims that shard a matrix dim (a batch dim
sharded over experts stays sharded: each rank holds whole expert matrices), orthogonalised, and
this rank's shard of the result taken back (a local slice, no communication). Memory bound: one
full matrix (or this rank's expert matrices of one weight) in fp32 plus ~6 copies in the
Newton–Schulz dtype (~16 B per element at the peak), at a time per rank; collectives: one all-gather of each
sharded matrix per
step. Every rank of a shard group orthogonalises the same matrix (redundant work); spreading the
matrices round-robin over the ranks (Axolotl's all-to-all batching) is a later optimisation.

Why Newton–Schulz is written here: torch's (``torch.optim._muon``) is private and runs one fixed
coefficient triple; Axolotl's FSDP2 Muon runs a per-iteration schedule (below), batched over experts.
"""

from __future__ import annotations

import math

import torch

NS_SCHEDULE = (
    (4.0848, -6.8946, 2.9270),
    (3.9505, -6.3029, 2.6377),
    (3.7418, -5.5913, 2.3037),
    (2.8769, -3.1427, 1.2046),
    (2.8366, -3.0525, 1.2012),
)
"""The quintic Newton–Schulz coefficients of each of the 5 iterations (Axolotl's / dion's Muon)."""

MUON_BETAS = (0.9, 0.95)
"""AdamW's betas for the non-matrix parameters when ``adam_beta1/2`` are not given (Axolotl's)."""

NOTE = (
    "Muon (Newton-Schulz orthogonalised momentum, Axolotl's FSDP2 algorithm: momentum 0.95, lr scaled by "
    "sqrt(fan_out/fan_in)) for the hidden matrices, each orthogonalised whole (gathered from its shards); "
    "AdamW without weight decay for embeddings, LM head, norms and biases (docs/optimizers.md)"
)


def newton_schulz(g: torch.Tensor, dtype: torch.dtype = torch.bfloat16, eps: float = 1e-7) -> torch.Tensor:
    """The approximate orthogonalisation ``U V^T`` of each matrix (last two dims) of ``g`` by
    ``NS_SCHEDULE``'s iterations in ``dtype`` (bf16 as Axolotl and torch; fp32 for exact checks)."""
    x = g.to(dtype)
    tall = x.size(-2) > x.size(-1)
    if tall:
        x = x.mT
    x = x / (x.norm(dim=(-2, -1), keepdim=True) + eps)
    for a, b, c in NS_SCHEDULE:
        gram = x @ x.mT
        x = a * x + (b * gram + c * (gram @ gram)) @ x
    return x.mT if tall else x


def spectral_lr(lr: float, shape: torch.Size) -> float:
    """Muon's step size for a matrix of ``shape`` (..., fan_out, fan_in)."""
    return lr * math.sqrt(shape[-2] / shape[-1])


def muon_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Axolotl's split: hidden matrices -> Muon (with decay); embeddings, LM head, PEFT's
    ``modules_to_save`` copies, 1-D -> AdamW (none). LoRA's A and B matrices get Muon, as in Axolotl."""
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    for get in ("get_input_embeddings", "get_output_embeddings"):
        module = getattr(model, get, lambda: None)()
        if module is not None and getattr(module, "weight", None) is not None:
            embeddings.add(id(module.weight))
    muon, adamw, seen = [], [], set()
    for name, p in model.named_parameters():
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        is_embedding = (
            id(p) in embeddings
            or "embed_tokens" in name
            or "lm_head" in name
            or name.endswith("modules_to_save.default.weight")
        )  # PEFT's trained copies
        (muon if p.ndim >= 2 and not is_embedding else adamw).append(p)
    groups = [{"params": muon, "algorithm": "muon", "weight_decay": weight_decay}]
    if adamw:
        groups.append({"params": adamw, "algorithm": "adamw", "weight_decay": 0.0})
    return groups


class MuonAdamW(torch.optim.Optimizer):
    """Groups with ``algorithm: "muon"`` step by Muon, the others by ``torch.optim.AdamW`` (sharing
    this optimizer's ``state`` and group dicts, so ``state_dict`` / DCP / schedulers see one
    optimizer). ``per_shard``: orthogonalise each rank's local shard instead of the whole matrix —
    wrong, kept only as the equivalence checks' negative control."""

    def __init__(
        self,
        groups: list[dict],
        lr: float = 0.02,
        momentum: float = 0.95,
        nesterov: bool = False,
        ns_dtype: torch.dtype = torch.bfloat16,
        betas: tuple[float, float] = MUON_BETAS,
        eps: float = 1e-8,
        per_shard: bool = False,
    ):
        adamw_groups = [g for g in groups if g.get("algorithm") == "adamw"]
        self._adamw = torch.optim.AdamW(adamw_groups, lr=lr, betas=betas, eps=eps) if adamw_groups else None
        super().__init__(
            groups,
            {"lr": lr, "algorithm": "muon", "momentum": momentum, "nesterov": nesterov, "weight_decay": 0.0},
        )
        self.ns_dtype, self.per_shard = ns_dtype, per_shard

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._adamw is not None:  # load_state_dict replaces state and groups: follow them
            self._adamw.state = self.state
            self._adamw.param_groups = [g for g in self.param_groups if g["algorithm"] == "adamw"]
            self._adamw.step()
        for group in self.param_groups:
            if group["algorithm"] == "muon":
                for p in group["params"]:
                    if p.grad is not None:
                        self._muon_update(p, group)
        return loss

    def _muon_update(self, p: torch.Tensor, group: dict) -> None:
        state = self.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(p)
        buf, mu = state["momentum_buffer"], group["momentum"]
        buf.mul_(mu).add_(p.grad)
        update = p.grad.add(buf, alpha=mu) if group["nesterov"] else buf
        ortho = self._orthogonalize(update)
        lr = group["lr"]
        p.mul_(1 - lr * group["weight_decay"])
        p.add_(ortho, alpha=-spectral_lr(lr, p.shape))

    def _orthogonalize(self, update: torch.Tensor) -> torch.Tensor:
        """Newton–Schulz of each whole matrix of ``update``, returned with ``update``'s placements."""
        from torch.distributed.tensor import DTensor, Replicate

        if not isinstance(update, DTensor):
            return newton_schulz(update, self.ns_dtype).to(update.dtype)
        mesh, placements = update.device_mesh, update.placements
        if self.per_shard:  # the negative control: each shard on its own
            local = newton_schulz(update.to_local(), self.ns_dtype).to(update.dtype)
            return DTensor.from_local(local, mesh, placements, shape=update.shape, stride=update.stride())
        matrix_dims = {update.ndim - 1, update.ndim - 2}
        whole = [
            pl
            if pl.is_replicate() or getattr(pl, "dim", None) not in matrix_dims and not pl.is_partial()
            else Replicate()
            for pl in placements
        ]  # (FSDP x TP's _StridedShard is no Shard to is_shard)
        gathered = update.redistribute(mesh, whole).to_local()
        ortho = newton_schulz(gathered, self.ns_dtype).to(update.dtype)
        del gathered
        return DTensor.from_local(
            ortho, mesh, whole, shape=update.shape, stride=update.stride()
        ).redistribute(mesh, placements)


def build_muon(
    model: torch.nn.Module, lr: float, weight_decay: float, betas: tuple[float, float], eps: float, **options
) -> MuonAdamW:
    """``optimizer: muon`` over ``model`` (``options``: ``MuonAdamW``'s keywords)."""
    return MuonAdamW(muon_groups(model, weight_decay), lr=lr, betas=betas, eps=eps, **options)
