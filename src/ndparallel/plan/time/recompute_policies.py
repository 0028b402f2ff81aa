"""Checkpointing policies besides 'full' (each layer's input kept, the layer recomputed): what the
runtime's selective policy (``techniques/selective_ac.py``) runs again in backward — time; its
saved set is ``plan/memory/activations.py::selective_saved_per_token`` — and torchtitan's per-op selective
policy (the policy 'op'), modelled for comparisons with its published rows, not run by ndparallel.
"""

from __future__ import annotations

from ndparallel.layout.dims import ParallelDims
from ndparallel.plan.models import ModelSpec
from ndparallel.plan.settings import Settings
from ndparallel.plan.time.membound import Bytes, norm_bytes

SELECTIVE_KERNELS = (7, 3)
"""Forward kernels the selective policy runs again: per RMSNorm (upcast, pow, mean, rsqrt, two
products, downcast — counted from transformers' code, not profiled) and for the MLP tail (SiLU,
product, ``down_proj``)."""


def selective_recompute(model: ModelSpec, layout: ParallelDims, s: Settings) -> tuple[Bytes, int]:
    """(element-wise bytes, kernels) per local token and layer that backward runs again under the
    selective policy: the norms' forward (two over ``h/t_sp``, Qwen3's q/k norms over
    ``(a+k)·d/t``) and SiLU + product over ``f/t`` (``5·e``); its ``down_proj`` GEMM is in
    ``gemm.SELECTIVE_RECOMPUTED``."""
    t = layout.tp
    t_sp = t if s.sequence_parallel else 1
    nf, _ = norm_bytes(s.act_bytes)
    out = nf * (2 * model.hidden / t_sp) + Bytes(5 * s.act_bytes * model.intermediate / t)
    norms = 2
    if model.qk_norm:
        out += nf * ((model.heads + model.kv_heads) * model.head_dim / t)
        norms += 2
    per_norm, tail = SELECTIVE_KERNELS
    return out, norms * per_norm + tail


def op_policy_saved_per_token(model: ModelSpec, layout: ParallelDims, s: Settings) -> float:
    """torchtitan's per-op policy (``selective_ac_option = 'op'``; policy 'op', modelled for
    comparisons with its published rows, not run by ndparallel): the layer input (``e·h/t_sp``),
    the outputs of q (``e·a·d/t``), v (``e·k·d/t``), gate (``e·f/t``) and down (``e·h``, before
    the reduce-scatter under SP: full), the attention output (``e·a·d/t``) and log-sum-exp
    (``4·a/t``)."""
    t, e = layout.tp, s.act_bytes
    t_sp = t if s.sequence_parallel else 1
    h, d = model.hidden, model.head_dim
    return (
        e * h / t_sp
        + e * (2 * model.heads + model.kv_heads) * d / t
        + e * model.intermediate / t
        + e * h
        + 4 * model.heads / t
    )
