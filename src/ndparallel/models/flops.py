"""Training FLOPs per token: the one definition the trainer's logged MFU and the planner share.

    flops/token = 4·N + 2·N_trained + 6·L·(a·d)·s

* N: parameters used in matmuls (every linear weight and the LM head — the embedding matrix when
  tied; the embedding lookup, norms and biases do no matmul). Each takes 2 FLOPs per token in
  forward and 2 for the input gradient in backward. In a mixture-of-experts model the *active*
  ones: the routers and top_k / E of the expert weights (a token runs k of the E experts);
* N_trained: those whose weight gradient is computed (2 more FLOPs per token): N for full
  fine-tuning, the adapters for LoRA (whose own forward/input-gradient FLOPs, ~4·N_adapter, are
  left out: N_adapter is ~0.5 % of N);
* attention as it runs with a causal mask: QKᵀ and PV cost 2·(2·a·d·s)/2 per token per layer
  forward (half the score matrix), backward twice that: 6·L·a·d·s (a heads of dim d, sequence s).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the planner imports this module: no torch at import time
    import torch.nn as nn


def train_flops_per_token(
    matmul_params: int, trained_matmul_params: int, layers: int, attention_dim: int, seq_len: int
) -> float:
    """Model FLOPs of one training token (forward + backward) per the module docstring."""
    return 4.0 * matmul_params + 2.0 * trained_matmul_params + 6.0 * layers * attention_dim * seq_len


def matmul_params(model: nn.Module) -> tuple[int, int]:
    """(N, N_trained) of a model, sharded or not (global shapes), tied weights once: the weights
    of its linear layers; LoRA adapters count as trained only, their frozen base as N."""
    import torch.nn as nn

    seen: set[int] = set()
    n = trained = 0
    for weight, share in _moe_weights(model):  # experts and routers are no nn.Linear
        seen.add(id(weight))
        n += int(weight.shape.numel() * share)
        trained += int(weight.shape.numel() * share) if weight.requires_grad else 0
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if not isinstance(module, nn.Linear) or weight is None or id(weight) in seen:
            continue
        seen.add(id(weight))
        numel = weight.shape.numel()
        if ".lora_" not in f".{name}":
            n += numel
        if weight.requires_grad:
            trained += numel
    return n, trained


def _moe_weights(model: nn.Module) -> list[tuple[nn.Parameter, float]]:
    """(weight, share of it one token multiplies with) of an MoE model's routers (1) and experts
    (top_k / E); empty for a dense model."""
    import torch.nn as nn

    from ndparallel.models.moe import experts_modules, moe_spec, router_modules  # torch: a real model

    spec = moe_spec(model)
    if spec is None:
        return []
    routers = [
        (m.weight, 1.0)
        for _, m, _ in router_modules(model)
        if isinstance(getattr(m, "weight", None), nn.Parameter)
    ]
    share = spec.top_k / spec.num_experts
    return routers + [
        (p, share) for _, m in experts_modules(model) for p in m.parameters(recurse=False) if p.dim() == 3
    ]


def attention_dim(config) -> int:
    """Query heads × head dim of an HF config (``head_dim`` when set, else hidden / heads)."""
    heads = config.num_attention_heads
    return heads * (getattr(config, "head_dim", None) or config.hidden_size // heads)
