"""Planner compute model by op class: GEMMs by shape, attention kernels, memory-bound bytes, and
the H200 rows it is checked against (hand-checked numbers; tiny: h 64, L 2, a 4, k 2, d 16,
f 128, V 256)."""

import dataclasses
import json
from pathlib import Path

import pytest

from ndparallel.layout.dims import ParallelDims
from ndparallel.plan.hardware import PRESETS as HW
from ndparallel.plan.hardware import Hardware
from ndparallel.plan.models import PRESETS
from ndparallel.plan.search.evaluation import estimate
from ndparallel.plan.settings import Settings
from ndparallel.plan.time.attention_time import (
    CP_FLASH_SLOWDOWN,
    MATH_BYTES_BWD,
    MATH_BYTES_FWD,
    attention_time,
    causal_fwd_flops,
)
from ndparallel.plan.time.compute import micro_batch_time, model_flops_per_token
from ndparallel.plan.time.gemm import ANCHOR_DIM, gemm_rate, micro_batch_gemms
from ndparallel.plan.time.membound import (
    OPTIMIZER_BYTES,
    fsdp_copy_bytes,
    layer_bytes_per_token,
    loss_bytes_per_token,
    norm_bytes,
)

TINY, H200 = PRESETS["tiny"], HW["h200"]
REFERENCE = Path(__file__).parents[1] / "bench" / "reference"


def test_gemm_flops_are_six_n_per_token():
    """Forward + input grad + weight grad = 6·N·T; checkpointing adds the layers' forward."""
    s = Settings(sequence_len=64, micro_batch_size=2)
    total = sum(g.flops for g in micro_batch_gemms(TINY, ParallelDims(), s))
    assert total == 6 * TINY.matmul_params * 128
    ck = sum(
        g.flops
        for g in micro_batch_gemms(
            TINY, ParallelDims(), Settings(sequence_len=64, micro_batch_size=2, activation_checkpointing=True)
        )
    )
    linear = TINY.matmul_params - TINY.vocab * TINY.hidden
    assert ck - total == 2 * linear * 128
    # tp divides every GEMM's FLOPs; cp divides the tokens.
    tp2 = sum(g.flops for g in micro_batch_gemms(TINY, ParallelDims(tp=2), s))
    cp2 = sum(g.flops for g in micro_batch_gemms(TINY, ParallelDims(cp=2), s))
    assert tp2 == cp2 == total / 2
    shapes = {(g.what, g.m, g.n, g.k) for g in micro_batch_gemms(TINY, ParallelDims(tp=2), s)}
    # k/v colwise: out 2·16/2 = 16; forward (T, out, in), dgrad (T, in, out), wgrad (out, in, T)
    assert {
        ("k/v_proj fwd", 128, 16, 64),
        ("k/v_proj dgrad", 128, 64, 16),
        ("k/v_proj wgrad", 16, 64, 128),
    } <= shapes


def test_selective_checkpointing_recomputes_down_proj_and_elementwise_only():
    """The selective policy (techniques/selective_ac.py) runs ``down_proj``'s forward GEMM again
    and the norms' and SwiGLU's element-wise work, not attention: its time lies between no
    checkpointing and full checkpointing, its extra GEMM FLOPs are those of ``down_proj``."""
    model, lay = PRESETS["llama-3.1-8b"], ParallelDims(tp=8)
    kw = dict(sequence_len=8192)
    none, full, sel = (
        micro_batch_time(
            model, lay, Settings(**kw, activation_checkpointing=ck, ac_policy=p), HW["h100-80gb"]
        )
        for ck, p in ((False, "full"), (True, "full"), (True, "selective"))
    )
    assert none.total < sel.total < full.total
    assert sel.attention == none.attention < full.attention
    assert none.elementwise < sel.elementwise < full.elementwise
    flops = {
        ck: sum(
            g.flops
            for g in micro_batch_gemms(
                model, lay, Settings(**kw, activation_checkpointing=ck, ac_policy="selective")
            )
        )
        for ck in (False, True)
    }
    down = 2 * 8192 * model.intermediate // 8 * model.hidden * model.layers
    assert flops[True] - flops[False] == down


def test_gemm_rate_curve_and_table():
    hw = Hardware("x", 1, 1000e12, 50e12, 1e12, 1, 1, matmul_efficiency=0.8, gemm_half_dim=128)
    n = ANCHOR_DIM
    assert gemm_rate(hw, n, n, n, hw.peak_flops) == pytest.approx(800e12)
    # one small dim: (64/192) / (8192/8320) of the anchor rate
    assert gemm_rate(hw, n, 64, n, hw.peak_flops) == pytest.approx(800e12 * (64 / 192) / (8192 / 8320))
    assert gemm_rate(hw, 2 * n, n, n, hw.peak_flops) == pytest.approx(800e12)  # capped
    table = Hardware(
        "x",
        1,
        1000e12,
        50e12,
        1e12,
        1,
        1,
        matmul_efficiency=0.8,
        gemm_table=[{"m": 100, "n": 200, "k": 300, "flops_per_s": 5e12}],
    )
    assert gemm_rate(table, 100, 200, 300, 1000e12) == 5e12  # measured shape
    assert gemm_rate(table, 100, 200, 300, 50e12) == 5e12 * 50 / 1000  # fp32
    # an unmeasured shape: the curve scaled by the nearest measured shape's measured/curve
    ratio = 5e12 / gemm_rate(hw, 100, 200, 300, 1000e12)
    assert gemm_rate(table, 100, 200, 600, 1000e12) == pytest.approx(
        gemm_rate(hw, 100, 200, 600, 1000e12) * ratio
    )


def test_attention_flops_and_kernels():
    s = Settings(sequence_len=64, micro_batch_size=2)
    # 2 layers · 2 sequences · 2·a·d·s² (causal QKᵀ + PV)
    assert causal_fwd_flops(TINY, ParallelDims(), s) == 2 * 2 * 2 * 4 * 16 * 64**2
    hw = Hardware(
        "x",
        1,
        100e12,
        10e12,
        1e12,
        1,
        1,
        matmul_efficiency=0.5,
        hbm_efficiency=0.5,
        attention_efficiency={"16": [0.25, 0.1]},
        cp_block_efficiency={},
    )
    fwd, bwd = attention_time(TINY, ParallelDims(), s, hw, hw.peak_flops)
    f = causal_fwd_flops(TINY, ParallelDims(), s)
    assert (fwd, bwd) == pytest.approx((f / 25e12, 2 * f / 10e12))
    # CP 2, flash kernel (the default): the causal work of s/c tokens at the causal kernel's
    # efficiency, CP_FLASH_SLOWDOWN times slower (the ring's blocks vs one flash call)
    fwd, bwd = attention_time(TINY, ParallelDims(cp=2), s, hw, hw.peak_flops)
    f_cp = causal_fwd_flops(TINY, ParallelDims(cp=2), s)
    assert f_cp == f / 2
    assert (fwd, bwd) == pytest.approx(
        (CP_FLASH_SLOWDOWN * f_cp / 25e12, CP_FLASH_SLOWDOWN * 2 * f_cp / 10e12)
    )
    # CP 2, math kernel: 2c+1 = 5 blocks per layer of 16-token chunks, fp32 matmuls + scores.
    fwd, bwd = attention_time(
        TINY, ParallelDims(cp=2), dataclasses.replace(s, cp_kernel="math"), hw, hw.peak_flops
    )
    block = 4 * 2 * 4 * 16 * 16**2
    scores = 2 * 4 * 16**2
    bw, rate = 0.5e12, 5e12
    assert fwd == pytest.approx(2 * 5 * (block / rate + scores * MATH_BYTES_FWD / bw))
    assert bwd == pytest.approx(2 * 5 * (2.5 * block / rate + scores * MATH_BYTES_BWD / bw))


def test_memory_bound_bytes_hand_checked():
    fwd, bwd = norm_bytes(2)
    assert (fwd.stream, fwd.broadcast, bwd.stream, bwd.broadcast) == (24, 12, 84, 12)
    assert norm_bytes(4)[0].stream == 12  # fp32: no casts
    f, b = layer_bytes_per_token(TINY, ParallelDims(), Settings(sequence_len=64))
    rope = (4 + 2) * 16  # q and k elements per token
    # norms 2·64·(24|84), residual adds 2·6·64, gradient sums 3·6·64, RoPE 12|22 (+8|8), MLP 10|18
    assert f.stream == 2 * 64 * 24 + 12 * 64 + 12 * rope + 10 * 128
    assert b.stream == 2 * 64 * 84 + 30 * 64 + 22 * rope + 18 * 128
    assert f.broadcast == b.broadcast == 2 * 64 * 12 + 8 * rope
    loss = loss_bytes_per_token(TINY, ParallelDims(), Settings(sequence_len=64))
    assert loss.stream == 44 * 256 + 108 * 64 and loss.broadcast == 24 * 64
    assert OPTIMIZER_BYTES[("adamw", True)] == 28 and OPTIMIZER_BYTES[("adamw", False)] == 84
    # FSDP on one rank (bf16): two gathers of 4+2 (cast) + 4 (copy-out) + 4 (1-rank copy) and one
    # reduction of 6 (concat to fp32) + 8 (1-rank copy) bytes per parameter.
    assert fsdp_copy_bytes(TINY, ParallelDims(), Settings(sequence_len=64), 10, 10) == 10 * (2 * 14 + 14)
    assert fsdp_copy_bytes(TINY, ParallelDims(), Settings(sequence_len=64, mixed_precision="fp32"), 1, 1) == 0


def test_host_floor_bounds_tiny_models():
    t = micro_batch_time(TINY, ParallelDims(), Settings(sequence_len=64), H200)
    assert t.host_floor > t.gemm + t.attention + t.elementwise + t.loss + t.launch
    assert t.total == t.host_floor


def _h200_rows():
    return json.loads((REFERENCE / "h200_plan_gpu_check.json").read_text())["rows"]


@pytest.mark.parametrize("profile", [None, "h200_profile.json"])
def test_h200_rows_tokens_per_s_within_15_percent(profile):
    """The six H200 runs of bench/plan_gpu_check.py, with the preset (measured efficiencies) and
    with the profile --calibrate wrote on that GPU."""
    from ndparallel.plan.hardware import load_hardware_file

    hw = load_hardware_file(REFERENCE / profile) if profile else H200
    for r in _h200_rows():
        s = Settings(
            sequence_len=r["seq"],
            micro_batch_size=r["micro_batch"],
            activation_checkpointing=r["checkpointing"],
            optimizer_fused=r["fused_adamw"],
        )
        e = estimate(PRESETS[r["planner_model"]], ParallelDims(), s, hw, 8)
        predicted = r["micro_batch"] * r["seq"] / e.time.step
        assert predicted == pytest.approx(r["tokens_per_s"], rel=0.15), r["config"]


def test_mfu_convention():
    m = PRESETS["llama-3.2-1b"]
    assert model_flops_per_token(m, 2048) == 6 * m.matmul_params + 6 * 16 * 32 * 64 * 2048
