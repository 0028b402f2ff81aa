"""Tensor-parallel plans: which module of a model gets which tensor-parallel style.

A plan maps module-name patterns (``*`` = one name component, e.g. a layer number) to Hugging Face
style names. It comes from the user (``TPOptions.plan`` / the YAML ``tp_plan`` key) or from the model
itself: ``config.base_model_tp_plan`` (prefixed with the base model attribute, e.g. ``model.``) plus
the causal-LM class's ``_tp_plan`` for ``lm_head``. The strings are turned into DTensor parallel
styles by ``ndparallel.parallel.tp.tensor``; this module only knows the model side.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from torch import nn

from ndparallel.models.layers import decoder_module_name
from ndparallel.models.moe import moe_prefixes

STYLES: dict[str, str] = {
    "colwise": "Linear weight sharded on out_features; output sharded on the last dim.",
    "rowwise": "Linear weight sharded on in_features; input sharded on the last dim; output summed.",
    "colwise_gather_output": "colwise, then the output gathered (lm_head; kept sharded under loss parallel).",
    "colwise_rep": "same as colwise_gather_output.",
    "rowwise_split_input": "rowwise on a replicated input (split locally).",
    "rowwise_rep": "same as rowwise_split_input.",
    "embedding_rowwise": "Embedding sharded on the vocabulary dim; lookups summed.",
    "embedding_colwise": "Embedding sharded on the hidden dim; outputs gathered.",
    "replicated_with_grad_allreduce": "replicated params on head-sharded input (e.g. Qwen3 q_norm/k_norm);"
    " gradients summed over tp.",
    "replicate": "replicated params on a replicated input.",
    "mla_kv_a_proj": "MLA's shared K/V down-projection (DeepSeek V2/V3, transformers >= 5.25): replicated,"
    " its gradient summed over tp by DTensor (the rope part bypasses the colwise kv_b_proj).",
    "sequence_parallel": "replicated params; input sharded on the sequence dim under sequence parallel.",
}
"""The Hugging Face style names ndparallel maps onto DTensor styles, with their meaning."""
RESIDUAL_STYLES = ("replicate", "sequence_parallel")
"""The styles of ``STYLES`` on the residual stream's own layout (replicated params, such as the
norms): Hugging Face's ``sequence_parallel`` style names the layout, not ndparallel's option."""

EXAMPLE_PLAN: dict[str, str] = {
    "model.layers.*.self_attn.q_proj": "colwise",
    "model.layers.*.self_attn.k_proj": "colwise",
    "model.layers.*.self_attn.v_proj": "colwise",
    "model.layers.*.self_attn.o_proj": "rowwise",
    "model.layers.*.mlp.gate_proj": "colwise",
    "model.layers.*.mlp.up_proj": "colwise",
    "model.layers.*.mlp.down_proj": "rowwise",
    "model.embed_tokens": "embedding_rowwise",
    "lm_head": "colwise_gather_output",
}
"""A Llama-style decoder plan, shown in errors and docs."""


class TPPlanError(ValueError):
    """No usable plan; the message says what to supply."""


def plan_prefix(model: nn.Module) -> str:
    """Where a base-model plan's keys (``layers.*.self_attn.q_proj``) live in ``model``: its
    ``base_model_prefix`` attribute when that is a module, else the module that runs the decoder
    layers (Llama 4: ``base_model_prefix`` is ``language_model``, the decoder is ``model``)."""

    prefix = getattr(model, "base_model_prefix", "")
    if prefix and isinstance(getattr(model, prefix, None), nn.Module):
        return prefix
    return decoder_module_name(model) or ""


def model_tp_plan(model: nn.Module) -> dict[str, str]:
    """The model's own HF plan, root-relative: base plan prefixed + the head class's ``_tp_plan``.

    Like transformers, a model with a plan gets ``embed_tokens: embedding_rowwise`` if it has none.
    Empty when the model has no plan.
    """
    config = getattr(model, "config", None)
    plan: dict[str, str] = dict(getattr(type(model), "_tp_plan", None) or {})
    base_plan = dict(getattr(config, "base_model_tp_plan", None) or {})
    prefix = plan_prefix(model)
    base = model.get_submodule(prefix) if prefix else None
    if base_plan and isinstance(base, nn.Module):
        if isinstance(getattr(base, "embed_tokens", None), nn.Embedding):
            base_plan = {"embed_tokens": "embedding_rowwise", **base_plan}
        plan.update({f"{prefix}.{k}": v for k, v in base_plan.items()})
    elif base_plan:  # the model is the base model itself
        plan.update(base_plan)
    if not base_plan:  # a head plan alone shards nothing useful; try the instance's plan
        plan = dict(getattr(model, "_tp_plan", None) or {})
        head_only = set(getattr(type(model), "_tp_plan", None) or {})
        return plan if set(plan) - head_only else {}
    return plan


def resolve_tp_plan(model: nn.Module, override: Mapping[str, object] | None = None) -> dict[str, object]:
    """The plan to apply: ``override`` (user's) if given, else the model's own HF plan.

    Raises ``TPPlanError`` naming what to supply when there is neither.
    """
    if override:
        return dict(override)
    plan = model_tp_plan(model)
    if not plan:
        example = ", ".join(f'"{k}": {v}' for k, v in EXAMPLE_PLAN.items())
        raise TPPlanError(
            f"{type(model).__name__} has no tensor-parallel plan (its config has no base_model_tp_plan "
            "and the class no _tp_plan): supply one with TPOptions(plan={...}) in Python or the "
            "`tp_plan` key of the YAML config, mapping module-name patterns to styles "
            f"({', '.join(STYLES)}), e.g. tp_plan: {{{example}}}"
        )
    return plan


def _pattern(key: str) -> re.Pattern[str]:
    return re.compile(r"\.".join("[^.]+" if p == "*" else re.escape(p) for p in key.split(".")))


def match_plan(model: nn.Module, plan: Mapping[str, object], *, strict: bool) -> dict[str, object]:
    """Expand plan patterns to ``{module name: style}`` over ``model.named_modules()``.

    A key that matches nothing is retried under the base-model prefix (``layers.*.mlp.up_proj`` ->
    ``model.layers.*.mlp.up_proj``); with ``strict`` (user plans) a key still matching nothing, or
    two keys giving one module different styles, raise ``TPPlanError``.
    """
    names = [n for n, _ in model.named_modules() if n]
    prefix = plan_prefix(model)
    out: dict[str, object] = {}
    for key, style in plan.items():
        hits = [n for n in names if _pattern(key).fullmatch(n)]
        if not hits and prefix:
            hits = [n for n in names if _pattern(f"{prefix}.{key}").fullmatch(n)]
        if not hits and strict:
            raise TPPlanError(
                f"tp_plan key {key!r} matches no module of {type(model).__name__}; module names "
                f"look like {names[:1] + [n for n in names if '.0.' in n][:4]}"
            )
        for name in hits:
            if name in out and out[name] != style:
                raise TPPlanError(f"module {name!r} gets two tp styles: {out[name]!r} and {style!r}")
            out[name] = style
    return out


def unmatched_keys(model: nn.Module, plan: Mapping[str, object]) -> list[str]:
    """The plan's keys that match no module of ``model`` (what applying it would drop)."""
    return [k for k in plan if not match_plan(model, {k: plan[k]}, strict=False)]


def tp_plan_problem(model: nn.Module, override: Mapping[str, object] | None = None) -> str | None:
    """Why ``model`` cannot be made tensor-parallel with its plan (or ``override``), or None: no
    plan, a style ndparallel does not apply, or a plan that shards nothing inside the decoder layers
    (its keys miss the module tree). Entries inside a mixture-of-experts block (the experts'
    ``moe_tp_experts`` / ``packed_colwise``, shared experts) are not applied: expert parallel
    takes the experts, the rest of the block is replicated over tp (``parallel/tp/tensor.py``)."""

    try:
        plan = resolve_tp_plan(model, override)
        assigned = match_plan(model, plan, strict=bool(override))
    except TPPlanError as e:
        return str(e)
    _, moe_blocks = moe_prefixes(model)
    assigned = {n: s for n, s in assigned.items() if not (moe_blocks and n.startswith(moe_blocks))}
    name = type(model).__name__
    odd = {n: s for n, s in assigned.items() if isinstance(s, str) and s not in STYLES}
    if odd:
        where, style = next(iter(odd.items()))
        return (
            f"{name}'s tensor-parallel plan gives {where} the style {style!r}, which ndparallel does not "
            "apply: train this model without tensor_parallel_size (dp_shard_size / context_parallel_size), "
            "or give a tp_plan without that style"
        )
    if not any(
        n.split(".")[-1] not in ("lm_head", "embed_tokens") and any(p.isdigit() for p in n.split("."))
        for n in assigned
    ):
        dropped = unmatched_keys(model, plan)
        return (
            f"{name}'s tensor-parallel plan shards no module inside its decoder layers (keys that match "
            f"nothing: {dropped[:4]}): give a tp_plan whose keys name its modules, e.g. "
            f"{[n for n, _ in model.named_modules() if '.0.' in n][:3]}"
        )
    return None
