"""Attention time with the kernel that actually runs.

Without CP the HF layer calls torch SDPA with ``is_causal=True`` and GQA (no repeated K/V): the
flash kernel on CUDA. Causal forward FLOPs per layer (QKᵀ and PV, half the score matrix):
``2·b·(a/t)·d·s²``; the backward is counted as twice that (the MFU convention; flash's backward
really does 2.5× the forward's matmuls, which is inside its measured efficiency).

With CP the ring (``parallel/cp/parallel_attention.py``) runs block kernels
(``parallel/cp/attention_kernels.py``)
over chunks of ``s/(2c)`` tokens; rank ``i`` holds chunks ``i`` and ``2c−1−i`` and computes
``2c−1`` full blocks plus 2 diagonal blocks per layer. Kernels:

* ``flash`` (what ``kernel="auto"`` runs on CUDA for bf16/fp16): torch's flash op per block, the
  diagonal blocks causal (half the work), so the work is the causal work of ``s/c`` tokens; the
  time is the causal flash kernel's at ``CP_FLASH_SLOWDOWN`` × (``bench/gpu_cp.py`` on an H200,
  2026-11-30: a 32k row as the ring's blocks at cp 4 took 1.25× torch's flash SDPA on the same work;
  packed documents 1.36×). ``sdpa`` is its old name.
* ``math`` (the reference; fp32 inputs): fp32 matmuls plus the score tensors written and read in
  fp32: ``MATH_BYTES_FWD`` / ``MATH_BYTES_BWD`` bytes per score element, counted from the code;
  backward matmuls = 2.5× the forward's (scores recomputed, dV, dP, dQ, dK); the diagonal blocks
  computed whole with a mask: ``2c+1`` blocks of ``4·b·(a/t)·d·(s/2c)²`` forward FLOPs each.
A calibrated profile (``cp_block_efficiency``) holds the efficiencies measured at the model's own
heads; a measured ``flash`` entry replaces the slowdown rule.
"""

from __future__ import annotations

from ndparallel.layout.dims import ParallelDims
from ndparallel.plan.hardware import Hardware
from ndparallel.plan.models import ModelSpec
from ndparallel.plan.settings import Settings

CP_FLASH_SLOWDOWN = 1.25
"""CP flash blocks vs one causal flash call on the same work (measured, see the module doc)."""
MATH_BYTES_FWD = 40
"""fp32 bytes per score element in the math block forward: scores written (4), scaled (8),
log-sum-exp read twice (8), ``exp(s - lse)`` (16), read by the PV matmul (4)."""
MATH_BYTES_BWD = 64
"""… and its backward: scores recomputed and scaled (12), ``exp(s - lse)`` (16), read by the dV
matmul (4), dP written (4), ``dP - delta`` (8), ``P·(…)`` (12), read by the dQ and dK matmuls (8)."""


def causal_fwd_flops(model: ModelSpec, layout: ParallelDims, s: Settings) -> float:
    """Model FLOPs of all layers' causal attention forward for one micro-batch on one GPU."""
    heads = model.heads // layout.tp
    per_seq = 2.0 * heads * model.head_dim * s.sequence_len**2
    return model.layers * s.micro_batch_size * per_seq / layout.cp


def cp_block_fwd_flops(model: ModelSpec, layout: ParallelDims, s: Settings) -> float:
    """FLOPs of one full CP block forward (one layer, one micro-batch, one GPU)."""
    chunk = s.sequence_len / (2 * layout.cp)
    return 4.0 * s.micro_batch_size * (model.heads // layout.tp) * model.head_dim * chunk**2


def flash_efficiency(hw: Hardware, head_dim: int) -> tuple[float, float]:
    """(forward, backward) efficiency of the causal kernel at the nearest measured head dim."""
    key = min(hw.attention_efficiency, key=lambda k: abs(int(k) - head_dim))
    fwd, bwd = hw.attention_efficiency[key]
    return fwd, bwd


def attention_time(
    model: ModelSpec, layout: ParallelDims, s: Settings, hw: Hardware, peak: float
) -> tuple[float, float]:
    """(forward, backward) seconds of all layers' attention for one micro-batch on one GPU
    (the recomputed forward under checkpointing is added by the caller)."""
    eff_f, eff_b = flash_efficiency(hw, model.head_dim)
    if layout.cp == 1:
        fwd = causal_fwd_flops(model, layout, s)
        return fwd / (peak * eff_f), 2 * fwd / (peak * eff_b)
    flops = cp_block_fwd_flops(model, layout, s)
    if s.cp_kernel == "flash":
        measured = hw.cp_block_efficiency.get("flash")
        blocks = 2 * layout.cp * model.layers  # 2c−1 full + 2 causal halves
        if measured:
            return (
                blocks * flops / (peak * measured["fwd"]),
                blocks * 2.5 * flops / (peak * measured["bwd"]),
            )
        fwd = causal_fwd_flops(model, layout, s)
        return (CP_FLASH_SLOWDOWN * fwd / (peak * eff_f), CP_FLASH_SLOWDOWN * 2 * fwd / (peak * eff_b))
    blocks = (2 * layout.cp + 1) * model.layers
    measured = hw.cp_block_efficiency.get(s.cp_kernel)
    if measured:
        return (blocks * flops / (peak * measured["fwd"]), blocks * 2.5 * flops / (peak * measured["bwd"]))
    chunk = s.sequence_len / (2 * layout.cp)
    scores = s.micro_batch_size * (model.heads // layout.tp) * chunk**2
    rate32 = hw.peak_flops_fp32 * hw.matmul_efficiency
    bw = hw.hbm_bw * hw.hbm_efficiency
    fwd = flops / rate32 + scores * MATH_BYTES_FWD / bw
    bwd = 2.5 * flops / rate32 + scores * MATH_BYTES_BWD / bw
    return blocks * fwd, blocks * bwd
