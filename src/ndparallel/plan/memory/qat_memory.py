"""QAT in the planner (``plan --qat int4/int8``): what torchao's fake quantisation keeps for backward.

ndparallel runs every torchao fake quantiser under an activation checkpoint
(``techniques/qat.py``: ``RecomputedQuantizer``), so a fake-quantised linear keeps the rounded weight
(and rounded input) in the compute dtype that ``F.linear`` needs for its backward, not the
quantiser's fp32 intermediates (18.5 bytes per int4 weight element without it). Measured by
``bench/qat_memory.py`` (CPU, bf16 compute as FSDP2's gathered weights; 2026-12-01), per decoder
layer beyond the same layer without QAT: ``per_weight × (its linear weight elements) + per_input ×
tokens × (its linears' input elements per token)``: 2 bytes per weight element (one bf16 copy,
trained or LoRA-frozen), 2 per input element and token with an activation quantiser (1 with LoRA).
MX formats save their packed fp4 inputs instead of bf16 ones: slightly less than without QAT.

Without activation checkpointing every layer keeps its share until its backward (~1x the layer's
bf16 weights); with it, one layer's while that layer is recomputed. The LM head is fake-quantised
too (its share is held until the loss backward). TP is refused with QAT (``techniques/qat.py``), so the
shares are of whole weights. fp32 compute: the copies are fp32 (twice the bytes). nvfp4 (Blackwell
only) is not measured; planned as mxfp4. ``quantize_embedding`` is not modelled (one table's copy).
"""

from __future__ import annotations

from ndparallel.plan.models import ModelSpec

QAT_FORMATS = ("int4", "int4/int8", "int4/float8", "float8/float8", "mxfp4/mxfp4")
"""weight[/activation] formats the planner models (``techniques/qat.py``'s combinations but nvfp4)."""

_PER_INPUT = {  # bytes per input element · token in bf16 (trained linears, LoRA's frozen ones)
    "int4": (0.0, 0.0),
    "int4/int8": (2.0, 1.0),
    "int4/float8": (2.0, 1.0),
    "float8/float8": (2.0, 1.0),
    "mxfp4/mxfp4": (-1.0, 0.0),
}


def qat_format(weight_dtype: str, activation_dtype: str | None) -> str:
    """The planner's name for a training config's QAT formats (nvfp4 planned as mxfp4)."""
    weight = {"nvfp4": "mxfp4"}.get(weight_dtype, weight_dtype)
    act = {"nvfp4": "mxfp4"}.get(activation_dtype, activation_dtype) if activation_dtype else None
    return f"{weight}/{act}" if act else weight


def qat_format_problem(fmt: str) -> str | None:
    if fmt in QAT_FORMATS:
        return None
    return (
        f"--qat {fmt}: not a modelled QAT format; use one of {', '.join(QAT_FORMATS)} "
        "(nvfp4: plan as mxfp4/mxfp4)"
    )


def qat_saved_bytes_per_weight(fmt: str, compute_bytes: int = 2) -> float:
    """Saved bytes per linear weight element: the rounded copy in the compute dtype (MX: none), frozen
    or not."""
    return 0.0 if fmt.startswith("mxfp4") else float(compute_bytes)


def qat_saved_bytes_per_input(fmt: str, frozen: bool = False, compute_bytes: int = 2) -> float:
    """Saved bytes per linear input element and token (the activation quantiser's rounded input)."""
    return _PER_INPUT[fmt][1 if frozen else 0] * compute_bytes / 2


def layer_linear_counts(model: ModelSpec) -> tuple[int, int]:
    """(weight elements, input elements per token) of one decoder layer's fake-quantised linears:
    q, k, v, o and, for a dense model, gate, up, down (an MoE layer's fused experts are not
    ``nn.Linear``s: not fake-quantised)."""
    h, q, kv, f = (
        model.hidden,
        model.heads * model.head_dim,
        model.kv_heads * model.head_dim,
        model.intermediate,
    )
    weights, inputs = h * (q + 2 * kv) + q * h, 3 * h + q
    if not model.is_moe:
        weights, inputs = weights + 3 * h * f, inputs + 2 * h + f
    return weights, inputs


def qat_layer_bytes(model: ModelSpec, fmt: str, tokens: float, frozen: bool, compute_bytes: int) -> float:
    """What one decoder layer keeps for backward because of QAT (``tokens``: this rank's)."""
    weights, inputs = layer_linear_counts(model)
    return (
        qat_saved_bytes_per_weight(fmt, compute_bytes) * weights
        + qat_saved_bytes_per_input(fmt, frozen, compute_bytes) * tokens * inputs
    )


def qat_head_bytes(model: ModelSpec, fmt: str, tokens: float, frozen: bool, compute_bytes: int) -> float:
    """The fake-quantised LM head's share (``frozen`` under LoRA), held until the loss backward."""
    return (
        qat_saved_bytes_per_weight(fmt, compute_bytes) * model.vocab * model.hidden
        + qat_saved_bytes_per_input(fmt, frozen, compute_bytes) * tokens * model.hidden
    )
