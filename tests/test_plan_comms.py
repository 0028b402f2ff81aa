"""Planner communication model: per-collective bytes/counts on hand-checked cases, link
placement, alpha-beta costs."""

import pytest

from ndparallel.layout.dims import ParallelDims
from ndparallel.plan.hardware import Hardware
from ndparallel.plan.models import PRESETS
from ndparallel.plan.time.comms import aggregate, predict_collectives
from ndparallel.plan.time.links import collective_time, group_is_intra_node

TINY = PRESETS["tiny"]  # layer 36,992 params; embed 16,384; final (norm + lm_head) 16,448


def test_fsdp_only():
    got = aggregate(predict_collectives(TINY, ParallelDims(dp_shard=2), sequence_len=32))
    assert got == {
        # layer shard 18,496 elements: bf16 all-gather x2 (fwd, bwd) x 2 layers
        ("all_gather", "dp_shard_cp", 18_496 * 2): 4,
        ("reduce_scatter", "dp_shard_cp", 36_992 * 4): 2,  # fp32, full unit in
        ("all_gather", "dp_shard_cp", 8_192 * 2): 2,  # embedding: fwd + bwd
        ("reduce_scatter", "dp_shard_cp", 16_384 * 4): 1,
        ("all_gather", "dp_shard_cp", 8_224 * 2): 1,  # norm + lm_head: not resharded
        ("reduce_scatter", "dp_shard_cp", 16_448 * 4): 1,
    }


def test_grad_accum_and_no_reshard_scale_counts():
    # Gathers and (by default) reduce-scatters happen every micro-batch, so gradients stay sharded;
    # the replica all-reduce runs once per step. With unsharded_grad_accumulation the
    # reduce-scatter too waits for the last micro-batch.
    got = aggregate(
        predict_collectives(
            TINY,
            ParallelDims(dp_shard=2),
            sequence_len=32,
            gradient_accumulation_steps=3,
            reshard_after_forward=False,
        )
    )
    assert got[("all_gather", "dp_shard_cp", 18_496 * 2)] == 2 * 3
    assert got[("reduce_scatter", "dp_shard_cp", 36_992 * 4)] == 2 * 3
    hsdp = aggregate(
        predict_collectives(
            TINY, ParallelDims(dp_replicate=2, dp_shard=2), sequence_len=32, gradient_accumulation_steps=3
        )
    )
    assert hsdp[("all_gather", "dp_shard_cp", 18_496 * 2)] == 4 * 3
    assert hsdp[("reduce_scatter", "dp_shard_cp", 36_992 * 4)] == 2 * 3
    assert hsdp[("all_reduce", "dp_replicate", 18_496 * 4)] == 2
    unsharded = aggregate(
        predict_collectives(
            TINY,
            ParallelDims(dp_replicate=2, dp_shard=2),
            sequence_len=32,
            gradient_accumulation_steps=3,
            unsharded_grad_accumulation=True,
        )
    )
    assert unsharded[("reduce_scatter", "dp_shard_cp", 36_992 * 4)] == 2
    assert unsharded[("all_reduce", "dp_replicate", 18_496 * 4)] == 2


def test_ddp_and_hsdp():
    ddp = aggregate(predict_collectives(TINY, ParallelDims(dp_replicate=2), sequence_len=32))
    assert ddp == {
        ("all_reduce", "dp_replicate", 36_992 * 4): 2,
        ("all_reduce", "dp_replicate", 16_384 * 4): 1,
        ("all_reduce", "dp_replicate", 16_448 * 4): 1,
    }
    hsdp = aggregate(predict_collectives(TINY, ParallelDims(dp_replicate=2, dp_shard=2), sequence_len=32))
    assert hsdp[("all_reduce", "dp_replicate", 18_496 * 4)] == 2  # the reduced shard
    assert hsdp[("reduce_scatter", "dp_shard_cp", 36_992 * 4)] == 2


def test_tensor_parallel_sequence_parallel():
    # 32 tokens x h=64 x bf16: full 4096 B, sequence shard 2048 B.
    got = aggregate(predict_collectives(TINY, ParallelDims(tp=2), sequence_len=32))
    assert got == {
        # 2 pairs x 2 layers x (fwd, bwd, the saved input shard re-gathered in bwd) + emb, head
        ("all_gather", "tp", 2048): 2 * 2 * 3 + 2,
        ("reduce_scatter", "tp", 4096): 2 * 2 * 2 + 2,
        # 3 loss-parallel fp32 stats (32 tokens x 4 B) + 5 norm-weight grads (64 x bf16)
        ("all_reduce", "tp", 128): 3 + 5,
    }
    ck = aggregate(
        predict_collectives(TINY, ParallelDims(tp=2), sequence_len=32, activation_checkpointing=True)
    )
    assert ck[("all_gather", "tp", 2048)] == 10 + 4  # recomputed forward repeats the layers' own


def test_tensor_parallel_without_loss_parallel_gathers_logits():
    got = aggregate(predict_collectives(TINY, ParallelDims(tp=2), sequence_len=32, loss_parallel=False))
    # 32 tokens x 128 local vocab x bf16; no loss-parallel statistics (only 5 norm grads remain)
    assert got[("all_gather", "tp", 32 * 128 * 2)] == 1
    assert got[("all_reduce", "tp", 128)] == 5


def test_tensor_parallel_all_reduce():
    got = aggregate(predict_collectives(TINY, ParallelDims(tp=2), sequence_len=32, sequence_parallel=False))
    # fwd: 2 rowwise outputs per layer; bwd: one per block input (attention, MLP), checked against
    # the runtime by tests/test_plan_vs_runtime.py; + embedding fwd, LM-head input grad bwd.
    assert got == {("all_reduce", "tp", 4096): 2 * 2 + 2 * 2 + 2, ("all_reduce", "tp", 128): 3}
    ck = aggregate(
        predict_collectives(
            TINY, ParallelDims(tp=2), sequence_len=32, sequence_parallel=False, activation_checkpointing=True
        )
    )
    assert ck[("all_reduce", "tp", 4096)] == 10 + 2  # recompute: attention output only


def test_checkpointing_recompute_skips_mlp_output_reduction():
    ck = aggregate(
        predict_collectives(TINY, ParallelDims(tp=2), sequence_len=32, activation_checkpointing=True)
    )
    assert ck[("reduce_scatter", "tp", 4096)] == 10 + 2


def test_context_parallel_allgather():
    got = aggregate(
        predict_collectives(TINY, ParallelDims(cp=2), sequence_len=32, cp_comm_strategy="allgather")
    )
    # per layer: local K/V (2048 B bf16) gathered once, fp32 dK/dV of both ranks reduce-scattered
    assert got[("all_gather", "cp", 2048)] == 2
    assert got[("reduce_scatter", "cp", 2 * 4096)] == 2
    assert not any(k[0] == "send_recv" for k in got)
    with pytest.raises(ValueError):
        predict_collectives(TINY, ParallelDims(cp=2), sequence_len=32, cp_comm_strategy="spiral")


def test_context_parallel_ulysses():
    """Ulysses: per layer and pass, one all-to-all of Q,K,V (16 tokens per rank × (4 + 2·2) heads
    × 16 × bf16) and one of the output (16 × 4 × 16 × 2 B), forward and backward; positions
    (int32) all-gathered per forward. K/V heads are raised to cp when fewer (replicated)."""
    got = aggregate(
        predict_collectives(TINY, ParallelDims(cp=2), sequence_len=32, cp_comm_strategy="ulysses")
    )
    got = {k: v for k, v in got.items() if k[1] == "cp"}  # FSDP over dp_shard_cp aside
    assert got == {("all_to_all", "cp", 4096): 4, ("all_to_all", "cp", 2048): 4, ("all_gather", "cp", 64): 2}
    ck = aggregate(
        predict_collectives(
            TINY,
            ParallelDims(cp=4),
            sequence_len=32,
            cp_comm_strategy="ulysses",
            activation_checkpointing=True,
        )
    )
    # 8 tokens per rank, kv heads 2 -> 4 (replicated): 8 × (4 + 8) × 16 × 2; recompute: 3 passes
    assert ck[("all_to_all", "cp", 8 * 12 * 16 * 2)] == 6 and ck[("all_gather", "cp", 32)] == 4


def test_ulysses_head_rule_rejects_layouts():
    from ndparallel.plan.search.layouts import structural_rejections
    from ndparallel.plan.settings import Settings

    s = Settings(sequence_len=64, cp_comm_strategy="ulysses")
    assert structural_rejections(ParallelDims(cp=4), TINY, 4, 8, s) == []  # 4 heads, 2 kv heads
    codes = [c for c, _ in structural_rejections(ParallelDims(cp=8), TINY, 8, 8, s)]
    assert codes == ["heads_cp"]
    assert structural_rejections(ParallelDims(cp=8), TINY, 8, 8, Settings(sequence_len=64)) == []  # ring


def test_scalar_collectives():
    # the gradient norm: one fp32 all-reduce over the whole world, whatever the layout
    norm = ("all_reduce", "world", 4)
    fsdp = aggregate(predict_collectives(TINY, ParallelDims(dp_shard=2), sequence_len=32, scalars=True))
    assert fsdp[("all_reduce", "dp", 8)] == 1 and fsdp[norm] == 1
    tp32 = aggregate(
        predict_collectives(TINY, ParallelDims(tp=2), sequence_len=32, scalars=True, mixed_precision="fp32")
    )
    assert tp32[norm] == 1 and ("all_reduce", "dp", 8) not in tp32
    both = aggregate(predict_collectives(TINY, ParallelDims(dp_shard=2, tp=2), sequence_len=32, scalars=True))
    assert both[norm] == 1 and not any(k[1] in ("tp", "dp_shard_cp") and k[2] == 4 for k in both)
    assert norm not in aggregate(predict_collectives(TINY, ParallelDims(), sequence_len=32, scalars=True))
    assert not any(
        k[2] in (4, 8) and k[0] == "all_reduce"
        for k in aggregate(predict_collectives(TINY, ParallelDims(dp_replicate=2), sequence_len=32))
    )
    # the step loss: one fp32 all-reduce over dp_cp when dp·cp > 1
    assert fsdp[("all_reduce", "dp_cp", 4)] == 1
    assert ("all_reduce", "dp_cp", 4) not in tp32


def test_context_parallel_ring():
    # 16 tokens per rank; K+V: 2 x 16 x kv 2 x d 16 = 1024 elements: 2048 B bf16, 4096 B fp32.
    got = aggregate(predict_collectives(TINY, ParallelDims(cp=2), sequence_len=32))
    # per layer: K/V fwd 1 hop + bwd 1 hop; dK/dV (fp32) 2 hops -> x 2 layers; FSDP over cp too.
    assert got[("send_recv", "cp", 2048)] == 4
    assert got[("send_recv", "cp", 4096)] == 4
    assert got[("all_gather", "dp_shard_cp", 18_496 * 2)] == 4
    cp4 = aggregate(
        predict_collectives(TINY, ParallelDims(cp=4), sequence_len=32, activation_checkpointing=True)
    )
    # 8 tokens: 1024 B; per layer K/V fwd 3 + recompute 3 + bwd 3 = 9, dK/dV 4 (2048 B)
    assert cp4[("send_recv", "cp", 1024)] == 18
    assert cp4[("send_recv", "cp", 2048)] == 8


def test_micro_batch_scales_activation_bytes():
    got = aggregate(predict_collectives(TINY, ParallelDims(tp=2), sequence_len=32, micro_batch_size=2))
    assert ("reduce_scatter", "tp", 8192) in got


@pytest.mark.parametrize(
    "layout,dim,expected",
    [
        (ParallelDims(2, 4, 1, 8), "tp", True),
        (ParallelDims(2, 4, 1, 8), "dp_shard", False),
        (ParallelDims(2, 4, 1, 8), "dp_replicate", False),
        (ParallelDims(8, 1, 1, 8), "dp_replicate", False),
        (ParallelDims(1, 2, 2, 4), "tp", True),  # world 16: stride 1, 4 | 8
        (ParallelDims(1, 2, 2, 4), "cp", True),  # stride 4, 2 x 4 = 8 | 8
        (ParallelDims(1, 2, 2, 4), "dp_shard", False),  # stride 8
        (ParallelDims(1, 2, 2, 4), "dp_shard_cp", False),
        (ParallelDims(8, 8, 1, 1), "dp_shard", True),
        (ParallelDims(1, 1, 1, 1), "tp", True),
    ],
)
def test_group_placement(layout, dim, expected):
    assert group_is_intra_node(layout, dim, gpus_per_node=8) is expected


def test_partial_node_is_intra():
    assert group_is_intra_node(ParallelDims(1, 6, 1, 1), "dp_shard", gpus_per_node=8)


def test_alpha_beta_ring():
    hw = Hardware(
        "x",
        1,
        1,
        1,
        1,
        intra_node_bw=100e9,
        inter_node_bw=10e9,
        intra_node_latency=1e-5,
        inter_node_latency=2e-5,
        link_efficiency=1.0,
    )
    # all-reduce of 1 GB over 8: 2*7*(alpha + b/(8B))
    assert collective_time("all_reduce", 1e9, 8, hw, True) == pytest.approx(14 * (1e-5 + 1.25e-3))
    # all-gather of a 1 GB shard over 4 inter-node: 3*(alpha + b/B)
    assert collective_time("all_gather", 1e9, 4, hw, False) == pytest.approx(3 * (2e-5 + 0.1))
    assert collective_time("reduce_scatter", 4e9, 4, hw, True) == pytest.approx(3 * (1e-5 + 1e-2))
    assert collective_time("send_recv", 1e6, 2, hw, True) == pytest.approx(1e-5 + 1e-5)
    assert collective_time("all_to_all", 4e9, 4, hw, True) == pytest.approx(3 * (1e-5 + 1e-2))
    assert collective_time("all_reduce", 1e9, 1, hw, True) == 0.0


def test_measured_table_used_for_intra_links():
    hw = Hardware(
        "x",
        1,
        1,
        1,
        1,
        100e9,
        10e9,
        link_efficiency=1.0,
        collectives={"all_reduce": {"2": {"alpha_s": 1e-3, "bus_bw": 1e9}}},
    )
    assert collective_time("all_reduce", 1e9, 2, hw, True) == pytest.approx(2 * (1e-3 + 0.5))
    # inter-node links keep the spec numbers
    assert collective_time("all_reduce", 1e9, 2, hw, False) == pytest.approx(2 * (15e-6 + 0.05))
