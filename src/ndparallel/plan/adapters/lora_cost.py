"""LoRA in the planner (``plan --adapter lora --lora-r R``): adapter sizes and what they change.

LoRA of rank r on every linear of a decoder layer (q, k, v, o, gate, up, down; not the LM head,
as PEFT's ``all-linear``): a linear ``in → out`` gets A (r × in) and B (out × r). Under TP
(``ndparallel.parallel.tp.lora``) a column-wise base keeps A whole and splits B on out, a row-wise
base splits A on in and keeps B whole. Per layer and tp rank (h hidden, q = a·d, kv = k·d, f MLP):

    colwise q, k, v, gate, up:  r·(5h + (q + 2kv + 2f)/tp)
    rowwise o, down:            r·((q + f)/tp + 2h)

FSDP shards those over dp_shard × cp like any parameter. An MoE model (no dense MLP, f = 0) has
LoRA on its four attention linears only (the fused expert weights are not adapted): 4h, not 7h. What LoRA
changes (see docs/planner.md):
the frozen base is kept in the compute dtype (bf16), only adapters hold fp32 master weights,
gradients and optimizer state; FSDP still all-gathers the whole base but reduce-scatters only
adapter gradients; matmul FLOPs are 4·N + 2·N_adapter (no weight gradients of the base).
"""

from __future__ import annotations

import math
from dataclasses import replace

from ndparallel.layout.dims import ParallelDims
from ndparallel.plan.models import ModelSpec
from ndparallel.plan.settings import Settings

ADAPTED = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
SAVED_MODULES = {
    "embed_tokens": "embed",
    "wte": "embed",
    "word_embeddings": "embed",
    "tok_embeddings": "embed",
    "lm_head": "head",
    "output": "head",
    "embed_out": "head",
}
"""``modules_to_save`` names the planner models (vocab × hidden tables) -> which table."""


def saved_tables(names) -> tuple[str, ...]:
    """The vocab × hidden tables ('embed', 'head') among ``modules_to_save`` names (others — norms,
    small layers — are not modelled)."""
    return tuple(
        sorted(
            {
                SAVED_MODULES[n.rsplit(".", 1)[-1]]
                for n in names or ()
                if n.rsplit(".", 1)[-1] in SAVED_MODULES
            }
        )
    )


def saved_copy_units(model: ModelSpec, tables: tuple[str, ...]) -> tuple[str, ...]:
    """FSDP units holding a trained full copy (``lora_modules_to_save``): PEFT keeps the frozen
    original and trains a copy of each table; tied embeddings keep one copy (in the root unit)."""
    if not tables:
        return ()
    if model.tied_embeddings:
        return ("root",)
    return tuple({"embed": "embed", "head": "final"}[t] for t in tables)


def head_copy_trains(model: ModelSpec, tables: tuple[str, ...]) -> bool:
    """Whether a trained copy of the LM head exists (tied: the one copy is the head too)."""
    return ("root" if model.tied_embeddings else "final") in saved_copy_units(model, tables)


def saved_copy_shard_numel(model: ModelSpec, layout: ParallelDims) -> int:
    """Elements of one trained copy on one rank (FSDP-sharded on the vocab dim; TP is refused)."""
    return math.ceil(model.vocab / layout.fsdp) * model.hidden


def adapter_params_per_layer(model: ModelSpec, r: int) -> int:
    """A and B elements of one decoder layer (all seven linears)."""
    h, q, kv, f = (
        model.hidden,
        model.heads * model.head_dim,
        model.kv_heads * model.head_dim,
        model.intermediate,
    )
    return r * ((4 if model.is_moe else 7) * h + 2 * q + 2 * kv + 3 * f)


def trainable_params(model: ModelSpec, r: int) -> int:
    """Adapter parameters of the whole model (what PEFT reports as trainable)."""
    return model.layers * adapter_params_per_layer(model, r)


def trainable_fraction(model: ModelSpec, r: int) -> float:
    return trainable_params(model, r) / model.num_params


def adapter_layer_local(model: ModelSpec, r: int, tp: int) -> int:
    """Adapter elements of one layer on one tp rank (before FSDP sharding)."""
    h, q, kv, f = (
        model.hidden,
        model.heads * model.head_dim,
        model.kv_heads * model.head_dim,
        model.intermediate,
    )
    colwise = (3 if model.is_moe else 5) * h + math.ceil((q + 2 * kv + 2 * f) / tp)
    rowwise = math.ceil((q + f) / tp) + (1 if model.is_moe else 2) * h
    return r * (colwise + rowwise)


def adapter_shard_numel(model: ModelSpec, layout: ParallelDims, r: int) -> int:
    """Adapter elements one rank holds (tp-local, then FSDP-sharded over dp_shard × cp)."""
    return model.layers * math.ceil(adapter_layer_local(model, r, layout.tp) / layout.fsdp)


def adapt_collectives(
    cs: list, model: ModelSpec, layout: ParallelDims, s: Settings, collective: type
) -> list:
    """The full fine-tune's collectives turned into LoRA's: FSDP/HSDP gradient reductions carry
    only adapter gradients (none for the frozen embedding, norm and LM head), replicated norm
    weights get no gradient all-reduce, and each adapted linear's replicated factor gets one tp
    all-reduce of its r·d fp32 elements per micro-batch."""
    r, n = s.lora_r, layout.fsdp
    local = adapter_layer_local(model, r, layout.tp)
    copies = saved_copy_units(model, s.lora_saved)
    copy = saved_copy_shard_numel(model, layout)
    out = []
    for c in cs:
        grad = c.what.startswith(("FSDP reduce-scatter", "HSDP all-reduce", "DDP all-reduce"))
        unit = c.what[c.what.rfind("(") + 1 : -1]
        if unit in copies:  # the frozen table and its trained copy: both gathered, the copy's grads reduced
            if grad:
                size = copy * n if c.kind == "reduce_scatter" else copy
                c = replace(c, bytes=size * s.reduce_bytes, what=c.what + ", trained copy")
            elif c.kind == "all_gather":
                c = replace(c, bytes=c.bytes + copy * s.param_compute_bytes, what=c.what + " + trained copy")
            out.append(c)
            continue
        if grad and "(layer)" not in c.what:
            continue  # embedding / final / root units: frozen
        if grad:
            size = math.ceil(local / n) * (n if c.kind == "reduce_scatter" else 1) if n > 1 else local
            c = replace(c, bytes=size * s.reduce_bytes, what=c.what + ", LoRA adapters")
        elif c.what.startswith("TP replicated-grad"):
            continue  # norm weights are frozen
        out.append(c)
    if layout.tp > 1:
        out.append(
            collective(
                "all_reduce",
                "tp",
                r * model.hidden * 4,
                (4 if model.is_moe else len(ADAPTED)) * model.layers * s.gradient_accumulation_steps,
                "TP LoRA replicated-factor grads (A of colwise, B of rowwise)",
            )
        )
    return out
