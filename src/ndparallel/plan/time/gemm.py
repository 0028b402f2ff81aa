"""The GEMMs of one micro-batch on one GPU, by shape, and the rate each runs at.

Every linear ``Y[T, out] = X[T, in] · Wᵀ`` (tp-local ``in``/``out``, ``T`` = tokens of the
micro-batch on this GPU: ``b·s/c``; under sequence parallel the colwise inputs are gathered to the
same ``T``) costs three GEMMs of ``2·T·in·out`` FLOPs, written ``(m, n, k)`` for ``[m,k]·[k,n]``:
forward ``(T, out, in)``, input gradient ``(T, in, out)``, weight gradient ``(out, in, T)``.
Activation checkpointing repeats the layers' forward GEMMs once.

Rate of one shape: a calibrated measurement of that very shape when the hardware profile has one
(``Hardware.gemm_table``, written by ``--calibrate`` over the model's own shapes), else the
curve ``peak · matmul_efficiency · g(m)·g(n)·g(k) / g(8192)³`` with ``g(x) = x / (x + x₀)``,
``x₀ = Hardware.gemm_half_dim``: ``matmul_efficiency`` is the fraction of peak an 8192³ GEMM
reaches, and each dimension that is small against ``x₀`` slows the GEMM (tiles run partly empty,
too few tiles to fill the SMs, less reuse per byte loaded).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ndparallel.layout.dims import ParallelDims
from ndparallel.plan import moe_cost
from ndparallel.plan.adapters.lora_cost import head_copy_trains
from ndparallel.plan.hardware import Hardware
from ndparallel.plan.memory.long_context import mlp_tiles
from ndparallel.plan.models import ModelSpec
from ndparallel.plan.settings import Settings

ANCHOR_DIM = 8192
"""The square GEMM whose rate ``matmul_efficiency`` states (what ``--calibrate --quick`` times)."""


@dataclass(frozen=True)
class Gemm:
    """``count`` GEMMs of shape ``[m, k] · [k, n]`` per micro-batch on one GPU."""

    what: str
    m: int
    n: int
    k: int
    count: int

    @property
    def flops(self) -> float:
        return 2.0 * self.m * self.n * self.k * self.count


def _linears(model: ModelSpec, tp: int) -> list[tuple[str, int, int, int]]:
    """(name, in, out, how many per layer) of a decoder layer's linears, tp-local."""
    h, d, f = model.hidden, model.head_dim, model.intermediate
    q, kv = model.heads * d // tp, model.kv_heads * d // tp
    return [
        ("q_proj", h, q, 1),
        ("k/v_proj", h, kv, 2),
        ("o_proj", q, h, 1),
        ("gate/up_proj", h, f // tp, 2),
        ("down_proj", f // tp, h, 1),
    ]


MLP_LINEARS = ("gate/up_proj", "down_proj")
"""The linears a tiled MLP runs per tile (``plan.long_context``)."""

SELECTIVE_RECOMPUTED = {"q_proj": 0, "k/v_proj": 0, "o_proj": 0, "gate/up_proj": 0, "down_proj": 1}
"""Linears per layer whose forward the selective policy recomputes (``techniques/selective_ac.py``:
the norms and ``down_proj(act_fn(gate) * up)`` run checkpointed, so ``down_proj``'s matmul runs
again in backward; nothing else)."""


OP_POLICY_RECOMPUTED = {"q_proj": 0, "k/v_proj": 1, "o_proj": 1, "gate/up_proj": 1, "down_proj": 0}
"""The same for torchtitan's per-op policy (policy 'op', for comparisons): it saves the
outputs of matmuls 1, 3, 5, 7 of a layer (q, v, gate, down) and recomputes 2, 4, 6 (k, o, up)."""


def micro_batch_gemms(model: ModelSpec, layout: ParallelDims, s: Settings) -> list[Gemm]:
    """Every GEMM of one micro-batch's forward + backward (+ recompute) on one GPU."""
    all_tokens = s.micro_batch_size * s.sequence_len // layout.cp
    tiles, tile_tokens = mlp_tiles(model, layout, s) if s.tiled_mlp else (1, all_tokens)
    out = []
    for name, i, o, per in _linears(model, layout.tp):
        if not o or not i:  # an MoE model has no dense MLP (f = 0)
            continue
        n = per * model.layers
        if s.recompute == "none":
            again = 0
        elif s.recompute in ("selective", "op"):
            again = (SELECTIVE_RECOMPUTED if s.recompute == "selective" else OP_POLICY_RECOMPUTED)[name]
            again *= model.layers
        else:
            again = n
        tokens = all_tokens
        if s.tiled_mlp and name in MLP_LINEARS:  # per tile, and the tile's forward once more
            tokens, n, again = int(tile_tokens), n * tiles, (again + n) * tiles
        out += [Gemm(f"{name} fwd", tokens, o, i, n + again), Gemm(f"{name} dgrad", tokens, i, o, n)]
        if not s.lora_r:
            out.append(Gemm(f"{name} wgrad", o, i, tokens, n))
            continue
        r = s.lora_r  # frozen base: no weight gradient; the adapter x·Aᵀ·Bᵀ, its two gradients each
        out += [
            Gemm(f"{name} lora A fwd", tokens, r, i, n + again),
            Gemm(f"{name} lora B fwd", tokens, o, r, n + again),
            Gemm(f"{name} lora B dgrad", tokens, r, o, n),
            Gemm(f"{name} lora B wgrad", o, r, tokens, n),
            Gemm(f"{name} lora A dgrad", tokens, i, r, n),
            Gemm(f"{name} lora A wgrad", r, i, tokens, n),
        ]
    if model.is_moe:  # the router, the experts' grouped GEMMs, the shared MLP (plan/moe_cost.py)
        out += moe_cost.gemms(model, layout, s, tokens, Gemm, recompute=s.activation_checkpointing)
    if not model.has_lm_head:  # a pipeline rank without the last stage
        return out
    vocab = -(-model.vocab // layout.tp)
    h = model.hidden
    out += [Gemm("lm_head fwd", all_tokens, vocab, h, 1), Gemm("lm_head dgrad", all_tokens, h, vocab, 1)]
    if not s.lora_r or head_copy_trains(
        model, s.lora_saved
    ):  # under LoRA the LM head is frozen, unless its copy trains
        out.append(Gemm("lm_head wgrad", vocab, h, all_tokens, 1))
    return out


def gemm_shapes(model: ModelSpec, layout: ParallelDims, s: Settings) -> list[tuple[int, int, int]]:
    """Distinct (m, n, k) of ``micro_batch_gemms`` (what calibration measures)."""
    return sorted({(g.m, g.n, g.k) for g in micro_batch_gemms(model, layout, s)})


def _g(x: float, x0: float) -> float:
    return x / (x + x0)


def curve_rate(hw: Hardware, m: int, n: int, k: int, peak: float) -> float:
    """The uncalibrated curve ``peak · matmul_efficiency · g(m)g(n)g(k)/g(8192)³`` (≤ the anchor)."""
    x0 = hw.gemm_half_dim
    shape = _g(m, x0) * _g(n, x0) * _g(k, x0) / _g(ANCHOR_DIM, x0) ** 3
    return peak * hw.matmul_efficiency * min(shape, 1.0)


def gemm_rate(hw: Hardware, m: int, n: int, k: int, peak: float) -> float:
    """FLOP/s of one ``(m, n, k)`` GEMM. With a calibrated table: the measured rate of that shape,
    or for a shape not measured the curve times measured/curve of the nearest measured shape (in
    log distance). Table rates are bf16; ``peak`` other than ``hw.peak_flops`` (fp32) scales them."""
    curve = curve_rate(hw, m, n, k, peak)
    if not hw.gemm_table:
        return curve

    def dist(row):
        return sum(abs(math.log(row[a] / b)) for a, b in (("m", m), ("n", n), ("k", k)))

    row = min(hw.gemm_table, key=dist)
    scale = peak / hw.peak_flops
    measured = row["flops_per_s"] * scale
    if dist(row) == 0:
        return measured
    return curve * measured / curve_rate(hw, row["m"], row["n"], row["k"], peak)


def gemm_time(hw: Hardware, gemms: list[Gemm], peak: float) -> float:
    """Seconds of all ``gemms`` run back to back."""
    return sum(g.flops / gemm_rate(hw, g.m, g.n, g.k, peak) for g in gemms)
