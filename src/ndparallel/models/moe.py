"""Mixture-of-experts knowledge of Hugging Face models (no parallel code): where a model keeps its
experts and routers, how many experts a token uses, and whether transformers adds the router's
load-balancing loss to the training loss.

transformers 5 stores the experts of one MoE layer as one module holding fused 3-D parameters
(``experts.gate_up_proj`` (E, 2·I, H) and ``experts.down_proj`` (E, H, I) for Qwen3-MoE and
Mixtral; transposed, with biases, for gpt-oss) whose class is decorated by
``transformers.integrations.moe.use_experts_implementation`` (the grouped-GEMM forward is one
of its implementations). The router is the module the model declares as the source of
``router_logits`` (``_can_record_outputs``); transformers' ``load_balancing_loss_func`` reads
output ``index`` of it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.nn as nn

from ndparallel.models.moe_config import config_num_experts


@dataclass(frozen=True)
class MoESpec:
    """The routing numbers of an MoE model."""

    num_experts: int
    top_k: int
    aux_loss_coef: float | None
    """``router_aux_loss_coef`` when transformers adds the load-balancing loss to this model's
    training loss (its causal-LM class has one and ``config.output_router_logits`` is true), else
    None (no auxiliary loss: DeepSeek-V3, or the switch off)."""


def is_experts_module(module: nn.Module) -> bool:
    """A transformers experts module: 3-D ``down_proj`` (one matrix per expert) and ``num_experts``."""
    down = getattr(module, "down_proj", None)
    return (
        isinstance(down, nn.Parameter)
        and down.dim() == 3
        and isinstance(getattr(module, "num_experts", None), int)
    )


def experts_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(name, module)`` of every experts module, in model order."""
    return [(n, m) for n, m in model.named_modules() if is_experts_module(m)]


def moe_prefixes(model: nn.Module) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(experts modules, MoE blocks = the experts' parents) as name prefixes ending in ``.``: what
    tensor parallel leaves to expert parallel (experts) and replicates (the rest of the block)."""
    experts = tuple(f"{n}." for n, _ in experts_modules(model))
    return experts, tuple(e.rsplit(".", 2)[0] + "." for e in experts)


def grouped_gemm_ready(module: nn.Module) -> bool:
    """Whether the experts class runs through transformers' experts implementations (the
    grouped-GEMM forward reads ``has_gate``, ``is_transposed``, ``has_bias`` ... from it)."""
    return all(hasattr(module, a) for a in ("has_gate", "has_bias", "is_transposed", "has_post_expert_norm"))


def router_recorder(model: nn.Module) -> tuple[type | str, int] | None:
    """(router class or class-name suffix, index of the logits in its output) as the model
    declares for ``router_logits``; None when it declares none."""
    declared = (getattr(type(model), "_can_record_outputs", None) or {}).get("router_logits")
    if declared is None:
        inner = getattr(model, getattr(model, "base_model_prefix", ""), None)
        if isinstance(inner, nn.Module) and inner is not model:
            return router_recorder(inner)
        return None
    if isinstance(declared, (list, tuple)):
        declared = declared[0]
    if isinstance(declared, type):
        return declared, 0
    target = getattr(declared, "target_class", None) or getattr(declared, "class_name", None)
    return (target, int(getattr(declared, "index", 0) or 0)) if target is not None else None


def router_modules(model: nn.Module) -> list[tuple[str, nn.Module, int]]:
    """``(name, router module, index of its logits output)`` of every router, in model order."""
    recorder = router_recorder(model)
    if recorder is None:
        return []
    target, index = recorder

    def matches(m: nn.Module) -> bool:
        return isinstance(m, target) if isinstance(target, type) else type(m).__name__.endswith(target)

    return [(n, m, index) for n, m in model.named_modules() if matches(m)]


def moe_spec(model: nn.Module) -> MoESpec | None:
    """The routing numbers of ``model`` (a causal LM, not wrapped), None for a dense model."""
    config = getattr(model, "config", None)
    experts = experts_modules(model)
    if config is None or not experts:
        return None
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    num = config_num_experts(text) or experts[0][1].down_proj.shape[0]
    top_k = int(getattr(text, "num_experts_per_tok", None) or getattr(text, "top_k", None) or 1)
    coef = getattr(model, "router_aux_loss_coef", None)
    on = bool(getattr(text, "output_router_logits", False)) and coef is not None
    return MoESpec(num, top_k, float(coef) if on else None)


def active_expert_fraction(model: nn.Module) -> float:
    """Share of the expert parameters one token uses (top_k / experts; 1 for a dense model)."""
    spec = moe_spec(model)
    return spec.top_k / spec.num_experts if spec else 1.0
