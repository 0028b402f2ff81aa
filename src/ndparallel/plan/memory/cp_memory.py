"""Context parallel's share of a layer's activation memory, per local token (``parallel/cp/``):
what a CP attention keeps for backward beyond the q, k, v, output and log-sum-exp of its own tokens
(``cp_saved_extra_per_token``, in every policy's saved set) and the buffers of its backward
(``attention_scratch_per_token``, in the layer-backward workspace of ``plan/memory/activations.py``)."""

from __future__ import annotations

from ndparallel.layout.dims import ParallelDims
from ndparallel.plan.models import ModelSpec
from ndparallel.plan.settings import Settings


def _cp_widths(model: ModelSpec, layout: ParallelDims) -> tuple[float, float, float]:
    """(query width a·d/t, K/V width k·d/t, Ulysses' K/V width per rank max(k/t, c)·d)."""
    t, d = layout.tp, model.head_dim
    return model.heads * d / t, model.kv_heads * d / t, max(model.kv_heads // t, layout.cp) * d


def cp_saved_extra_per_token(model: ModelSpec, layout: ParallelDims, s: Settings) -> float:
    """What a CP attention keeps beyond q, k, v, out, lse of its own tokens, per local token:
    ``allgather`` the other ranks' K/V (``2·e·k·d/t·(c−1)``); ``ulysses`` its heads-layout
    output (``e·a·d/t``) and the K/V copies when K/V heads are replicated to cp."""
    c, e = layout.cp, s.act_bytes
    if c == 1:
        return 0.0
    q, kv, kv_u = _cp_widths(model, layout)
    if s.cp_comm_strategy == "allgather":
        return 2 * e * kv * (c - 1)
    if s.cp_comm_strategy == "ulysses":
        return e * q + 2 * e * max(0.0, kv_u - kv)
    return 0.0


def attention_scratch_per_token(model: ModelSpec, layout: ParallelDims, s: Settings) -> float:
    """Buffers of one layer's CP attention backward per local token (``parallel/cp/parallel_attention.py``):
    ``ring`` dQ in fp32 (``4·a·d/t``), K/V stacked and its receive buffer (``4·e·k·d/t``), the fp32
    dK/dV contribution, the one received and the one being sent (``24·k·d/t``) and dQ's cast
    (``e·a·d/t``); ``allgather`` dQ in fp32 and its cast, the whole sequence's fp32 dK/dV and its
    rank-major copy (``16·k·d/t·c``); ``ulysses`` (document path: blocks written in place, no fp32
    accumulator) the heads-layout Q/K/V gradients and the all-to-all buffers (``2·e·(a+2k')·d``).
    Without CP (torch's SDPA) the kernel's own scratch is O(block): 0."""
    c, e = layout.cp, s.act_bytes
    if c == 1:
        return 0.0
    q, kv, kv_u = _cp_widths(model, layout)
    if s.cp_comm_strategy == "allgather":
        return 4 * q + 16 * kv * c + e * q
    if s.cp_comm_strategy == "ulysses":
        return 2 * e * (q + 2 * kv_u)
    return 4 * q + 4 * e * kv + 24 * kv + e * q
