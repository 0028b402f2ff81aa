"""QAT in the planner (``plan --qat int4/int8``): what torchao's fake quantisation keeps for backward.

Every fake-quantised linear runs its quantiser in autograd: for a trained weight, the rounded
weight and the quantiser's intermediates (fp32) stay saved until the layer's backward; an
activation quantiser keeps its own for the linear's input. Measured by ``bench/qat_memory.py``
(CPU, bf16 compute as FSDP2's gathered weights; 2026-12-01), per decoder layer beyond the same layer
without QAT: ``per_weight × (its linear weight elements) + per_input × tokens × (its linears' input
elements per token)``. With LoRA (frozen base) only the rounded weight in the compute dtype is kept
for the input gradient (2 bytes per element in bf16) plus the activation quantiser's share.
MX formats save their packed fp4 inputs instead of bf16 ones: slightly less than without QAT.

Without activation checkpointing every layer keeps its share until its backward (int4 weights: ~9×
the layer's bf16 weights); with it, one layer's share exists while that layer is recomputed. The
LM head is fake-quantised too (its share is held until the loss backward). TP is refused with QAT
(``parallel/qat.py``), so the shares are of whole (unsharded by TP) weights. nvfp4 (Blackwell only)
is not measured; planned as mxfp4. ``quantize_embedding`` is not modelled (weights-only int4 on one
embedding table).
"""

from __future__ import annotations

from ndparallel.plan.models import ModelSpec

QAT_FORMATS = ("int4", "int4/int8", "int4/float8", "float8/float8", "mxfp4/mxfp4")
"""weight[/activation] formats the planner models (``parallel/qat.py``'s combinations but nvfp4)."""

_TRAINED = {  # bytes per weight element, per input element · token (bf16 compute)
    "int4": (18.5, 0.0), "int4/int8": (18.5, 5.0), "int4/float8": (24.3, 16.0),
    "float8/float8": (16.0, 16.0), "mxfp4/mxfp4": (0.0, -1.0),
}
_FROZEN_INPUT = {"int4": 0.0, "int4/int8": 4.0, "int4/float8": 15.0, "float8/float8": 15.0, "mxfp4/mxfp4": 0.0}


def qat_format(weight_dtype: str, activation_dtype: str | None) -> str:
    """The planner's name for a training config's QAT formats (nvfp4 planned as mxfp4)."""
    weight = {"nvfp4": "mxfp4"}.get(weight_dtype, weight_dtype)
    act = {"nvfp4": "mxfp4"}.get(activation_dtype, activation_dtype) if activation_dtype else None
    return f"{weight}/{act}" if act else weight


def qat_format_problem(fmt: str) -> str | None:
    if fmt in QAT_FORMATS:
        return None
    return f"--qat {fmt}: not a modelled QAT format; use one of {', '.join(QAT_FORMATS)} (nvfp4: plan as mxfp4/mxfp4)"


def qat_saved_bytes_per_weight(fmt: str, frozen: bool = False, compute_bytes: int = 2) -> float:
    """Saved bytes per linear weight element (``frozen``: LoRA's base, the rounded copy only)."""
    if frozen:
        return 0.0 if fmt.startswith("mxfp4") else float(compute_bytes)
    return _TRAINED[fmt][0]


def qat_saved_bytes_per_input(fmt: str, frozen: bool = False) -> float:
    """Saved bytes per linear input element and token (the activation quantiser's share)."""
    return _FROZEN_INPUT[fmt] if frozen else _TRAINED[fmt][1]


def layer_linear_counts(model: ModelSpec) -> tuple[int, int]:
    """(weight elements, input elements per token) of one decoder layer's fake-quantised linears:
    q, k, v, o and, for a dense model, gate, up, down (an MoE layer's fused experts are not
    ``nn.Linear``s: not fake-quantised)."""
    h, q, kv, f = model.hidden, model.heads * model.head_dim, model.kv_heads * model.head_dim, model.intermediate
    weights, inputs = h * (q + 2 * kv) + q * h, 3 * h + q
    if not model.is_moe:
        weights, inputs = weights + 3 * h * f, inputs + 2 * h + f
    return weights, inputs


def qat_layer_bytes(model: ModelSpec, fmt: str, tokens: float, frozen: bool, compute_bytes: int) -> float:
    """What one decoder layer keeps for backward because of QAT (``tokens``: this rank's)."""
    weights, inputs = layer_linear_counts(model)
    return (qat_saved_bytes_per_weight(fmt, frozen, compute_bytes) * weights
            + qat_saved_bytes_per_input(fmt, frozen) * tokens * inputs)


def qat_head_bytes(model: ModelSpec, fmt: str, tokens: float, frozen: bool, compute_bytes: int) -> float:
    """The fake-quantised LM head's share (``frozen`` under LoRA), held until the loss backward."""
    return (qat_saved_bytes_per_weight(fmt, frozen, compute_bytes) * model.vocab * model.hidden
            + qat_saved_bytes_per_input(fmt, frozen) * tokens * model.hidden)
