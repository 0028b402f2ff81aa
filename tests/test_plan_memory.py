"""Planner memory model on hand-checked cases (the tiny preset: h=64, L=2, a=4, kv=2, d=16,
f=128, V=256, untied: 106,816 parameters, 36,992 per layer)."""

import dataclasses

import pytest

from ndparallel.layout.dims import ParallelDims
from ndparallel.plan.hardware import PRESETS as HW
from ndparallel.plan.memory.activations import layer_activation_bytes_per_token
from ndparallel.plan.memory.peak import FRAGMENTATION, MOMENTS, _activation_terms, estimate_memory
from ndparallel.plan.models import PRESETS, ParamSpec
from ndparallel.plan.settings import Settings
from ndparallel.plan.time.comms import fsdp_shard_numel, unit_numels

TINY = PRESETS["tiny"]
H100 = HW["h100-80gb"]


def test_tiny_counts():
    assert TINY.num_params == 106_816
    assert TINY.layer_params == 36_992


def test_fsdp_shard_padding():
    # dim 0 split in ceil(d0/n) rows, padded: q [64,64] over 3 -> 22 rows of 64.
    assert fsdp_shard_numel(ParamSpec("q", (64, 64), 0, "layer"), tp=1, fsdp=3) == 22 * 64
    # rowwise o_proj [64, 64] under tp=2 is [64, 32] locally, then 22 rows of 32 over fsdp=3.
    assert fsdp_shard_numel(ParamSpec("o", (64, 64), 1, "layer"), tp=2, fsdp=3) == 22 * 32
    # norms replicated over tp: [64] -> 22.
    assert fsdp_shard_numel(ParamSpec("n", (64,), None, "layer"), tp=2, fsdp=3) == 22
    local, shard = unit_numels(TINY, tp=1, fsdp=3)["layer"]
    # norms 22+22, q 1408, k 704, v 704, o 1408, gate/up 43*64 each, down 22*128
    assert (local, shard) == (36_992, 22 + 22 + 1408 + 704 + 704 + 1408 + 2 * 2752 + 2816)


def test_activation_bytes_per_token_hand_checked():
    s = Settings(sequence_len=32)
    # tp=1, bf16: norms 2*((4+2)*64 + 4 rstd)=776, inputs 2*2*64=256, q/k/v 2*(4+2*2)*16=256,
    # attn out 2*4*16=128, lse 4*4=16, MLP 4*2*128=1024  -> 2456
    assert layer_activation_bytes_per_token(TINY, ParallelDims(), s) == 2456
    # tp=2 with SP, the block inputs saved as sequence shards: 388 + 128 + 128 + 64 + 8 + 512
    assert layer_activation_bytes_per_token(TINY, ParallelDims(tp=2), s) == 1228
    # the gathered inputs saved whole (sp_saved_shards off): 388 + 256 + 128 + 64 + 8 + 512
    s_gathered = Settings(sequence_len=32, sequence_parallel_saved_shards=False)
    assert layer_activation_bytes_per_token(TINY, ParallelDims(tp=2), s_gathered) == 1356
    # tp=2 without SP: norms not split -> 776 + 256 + 128 + 64 + 8 + 512
    s_nosp = Settings(sequence_len=32, sequence_parallel=False)
    assert layer_activation_bytes_per_token(TINY, ParallelDims(tp=2), s_nosp) == 1744


def test_states_sharded_by_fsdp_and_tp():
    s = Settings(sequence_len=32, set_to_none=False)  # gradients kept allocated between steps
    one = estimate_memory(TINY, ParallelDims(), s, H100)
    assert one.params == 106_816 * 4 and one.grads == 106_816 * 4
    assert one.optimizer == 106_816 * 8
    fsdp2 = estimate_memory(TINY, ParallelDims(dp_shard=2), s, H100)
    assert fsdp2.params == 106_816 * 4 / 2  # every dim 0 is even: no padding
    # dp_replicate does not shard; cp shards like dp_shard (FSDP over dp_shard x cp).
    assert estimate_memory(TINY, ParallelDims(dp_replicate=2), s, H100).params == one.params
    assert estimate_memory(TINY, ParallelDims(cp=2), s, H100).params == fsdp2.params
    sgd = estimate_memory(
        TINY, ParallelDims(), Settings(sequence_len=32, optimizer="sgd", set_to_none=False), H100
    )
    assert sgd.optimizer == 0


def test_activations_checkpointing_and_cp():
    # fused AdamW (the trainer's on CUDA) has no step temporaries: the peak stays in backward
    s = Settings(sequence_len=32, micro_batch_size=2, optimizer_fused=True)
    tokens = 64
    m = estimate_memory(TINY, ParallelDims(), s, H100)
    assert m.activation_bytes_per_layer == 2456 * tokens
    rope = 2 * tokens * 16 * 2  # cos, sin: (b, s, d) bf16, shared by the layers
    saved = 2 * 2456 * tokens + rope
    # logits bf16 + fp32 log-softmax + 2 fp32 grads; final norm (fp32 in, normalized, rstd) and
    # LM-head input
    logits = tokens * 256 * 14 + tokens * (6 * 64 + 4 + 2 * 64)
    # the layer-backward workspace, inside the product's backward: the product's, SiLU's and up's
    # gradients where the product was (2·e·f more) and the incoming residual gradient (e·h)
    workspace = (2 * 2 * 128 + 2 * 64) * tokens
    if m.peak_phase == "loss backward":
        assert m.activations == saved and m.logits == logits
    else:
        assert m.activations == saved + workspace and m.logits == 0
    ck = estimate_memory(
        TINY,
        ParallelDims(),
        Settings(sequence_len=32, micro_batch_size=2, activation_checkpointing=True, optimizer_fused=True),
        H100,
    )
    # checkpointing keeps only each layer's bf16 input: L * tokens * 2 * h (+ RoPE cos/sin)
    assert ck.activations in (
        2 * tokens * 2 * 64 + rope,
        2 * tokens * 2 * 64 + rope + 2456 * tokens + workspace,
    )
    cp2 = estimate_memory(TINY, ParallelDims(cp=2), s, H100)
    assert cp2.activation_bytes_per_layer == m.activation_bytes_per_layer / 2


def test_accumulation_keeps_unsharded_fp32_grads():
    s1 = Settings(sequence_len=32, gradient_accumulation_steps=1, set_to_none=False)
    s4 = Settings(sequence_len=32, gradient_accumulation_steps=4, unsharded_grad_accumulation=True)
    every = Settings(sequence_len=32, gradient_accumulation_steps=4)  # the default keeps gradients sharded
    lay = ParallelDims(dp_shard=2, tp=2)
    base = estimate_memory(TINY, lay, s1, H100).grads
    local = sum(unit_numels(TINY, 2, 2)[u][0] * c for u, c in (("layer", 2), ("embed", 1), ("final", 1)))
    # until the step's one reduction only the unsharded fp32 gradients exist (set_to_none); a
    # unit's sharded one replaces its unsharded one when it is reduced (simulate of PP ranks:
    # docs/simulate.md)
    assert estimate_memory(TINY, lay, s4, H100).grads == local * 4
    assert estimate_memory(TINY, lay, every, H100).grads == base


def test_loss_parallel_shards_logits():
    # fp32, 512 tokens per rank: the loss moment is the peak with and without loss parallel.
    lay = ParallelDims(tp=2)
    kw = dict(sequence_len=256, micro_batch_size=2, mixed_precision="fp32")
    lp = estimate_memory(TINY, lay, Settings(**kw), H100)
    full = estimate_memory(TINY, lay, Settings(**kw, loss_parallel=False), H100)
    assert lp.peak_phase == full.peak_phase == "loss backward"
    # full vocab 256 at e+12 = 16 B vs the local 128 at e+16 = 20 B (loss parallel's fused
    # backward holds zeros_like(x), exp(x) and their sum at once)
    assert full.logits - lp.logits == 512 * (256 * 16 - 128 * 20)


def test_parts_sum_to_total_and_overhead():
    for lay in (ParallelDims(), ParallelDims(dp_shard=2, tp=2), ParallelDims(dp_replicate=2, cp=2)):
        m = estimate_memory(PRESETS["llama-3.1-8b"], lay, Settings(sequence_len=4096), H100)
        parts = m.params + m.grads + m.optimizer + m.activations + m.logits + m.fsdp_buffers
        assert m.total == pytest.approx(parts + m.overhead)
        transient = m.activations + m.logits + m.fsdp_buffers
        assert m.overhead == pytest.approx(H100.runtime_overhead_bytes + FRAGMENTATION * transient)


def test_llama8b_single_gpu_states():
    # 8.03B params x (4 param + 4 grad + 8 AdamW) = 128.5 GB: does not fit one GPU.
    m = estimate_memory(
        PRESETS["llama-3.1-8b"], ParallelDims(), Settings(sequence_len=4096, set_to_none=False), H100
    )
    assert m.params + m.grads + m.optimizer == 8_030_261_248 * 16
    assert m.total > H100.mem_bytes


def test_gradients_follow_set_to_none():
    """zero_grad(set_to_none=True): one micro-batch has no gradient at the loss moment; with
    accumulation the earlier micro-batches' (sharded) gradients are there."""
    lay, model = ParallelDims(dp_shard=2), PRESETS["llama-3.2-1b"]
    one = estimate_memory(model, lay, Settings(sequence_len=2048, micro_batch_size=4), H100)
    kept = estimate_memory(
        model, lay, Settings(sequence_len=2048, micro_batch_size=4, set_to_none=False), H100
    )
    acc = estimate_memory(
        model, lay, Settings(sequence_len=2048, micro_batch_size=4, gradient_accumulation_steps=2), H100
    )
    assert one.peak_phase == "loss backward" and one.grads == 0
    assert kept.grads == acc.grads == kept.params  # fp32 grads of the shard, like the params
    assert kept.total - one.total == pytest.approx(kept.params)


def test_end_of_backward_moment_for_state_heavy_layouts():
    # 8B on one GPU with checkpointing and a short sequence: states dominate; the peak is the end
    # of backward (all gradients present), 16 B per parameter.
    m = estimate_memory(
        PRESETS["llama-3.1-8b"],
        ParallelDims(),
        Settings(sequence_len=256, activation_checkpointing=True, optimizer_fused=True),
        H100,
    )
    assert m.peak_phase == "end of backward"
    assert m.params + m.grads + m.optimizer == 8_030_261_248 * 16
    assert m.activations == m.logits == m.fsdp_buffers == 0


def test_unfused_adamw_step_holds_two_copies_of_the_largest_tensor():
    """The optimizer-step moment: unfused AdamW's temporaries (2 × the largest local tensor; the
    H200 foreach row measured 1.96 GiB = 2 × Llama-3.2-1B's embedding), none when fused or SGD."""
    from ndparallel.plan.memory.states import optimizer_step_temporaries

    model = PRESETS["llama-3.2-1b"]
    s = Settings(sequence_len=256, activation_checkpointing=True)
    assert optimizer_step_temporaries(model, ParallelDims(), s) == 2 * 4 * 128256 * 2048
    assert optimizer_step_temporaries(model, ParallelDims(dp_shard=2, tp=2), s) == 2 * 4 * 128256 * 2048 / 4
    assert (
        optimizer_step_temporaries(model, ParallelDims(), Settings(sequence_len=256, optimizer_fused=True))
        == 0
    )
    assert optimizer_step_temporaries(model, ParallelDims(), Settings(sequence_len=256, optimizer="sgd")) == 0
    m = estimate_memory(PRESETS["llama-3.1-8b"], ParallelDims(), s, H100)
    assert m.peak_phase == "optimizer step"
    assert m.grads == 8_030_261_248 * 4 + 2 * 4 * 128256 * 4096


def test_chunked_loss_holds_one_chunk():
    model, lay = PRESETS["llama-3.2-1b"], ParallelDims()
    kw = dict(sequence_len=2048, micro_batch_size=4)
    full = estimate_memory(model, lay, Settings(**kw), H100)
    chunked = estimate_memory(model, lay, Settings(**kw, chunked_loss=True, loss_chunk_tokens=1024), H100)
    side = 8192 * (6 * 2048 + 4 + 2 * 2048)  # final norm + LM-head input, unchanged
    assert full.logits == 8192 * 128256 * 14 + side
    # at the loss moment: one chunk's fp32 logits + bf16 copy, the bf16 hidden-state gradient, the
    # fp32 head-weight gradient accumulator and one vocabulary slice of a chunk's bf16 contribution
    # with its fp32 copy (chunk x vocab elements: 1024 x 128256 / 2048 = 64128 rows of the head;
    # chunked_ce computes the gradients in its forward; tests/test_plan_chunked_loss.py measures it)
    from ndparallel.plan.memory.logits import logits_bytes

    s_chunk = Settings(**kw, chunked_loss=True, loss_chunk_tokens=1024)
    assert (
        logits_bytes(model, lay, s_chunk, 8192)
        == (1024 * 128256 * 6 + 8192 * 2048 * 2 + 128256 * 2048 * 4 + 64128 * 2048 * (2 + 4)) + side
    )
    assert chunked.total < full.total - 10 * 2**30
    # the default chunk follows the runtime: the largest power of two of tokens whose fp32 logits
    # fit 256 MiB (vocab 128,256 -> 512 tokens)
    auto = logits_bytes(model, lay, Settings(**kw, chunked_loss=True), 8192)
    assert auto == logits_bytes(model, lay, s_chunk, 8192) - 512 * 128256 * 12


def test_op_policy_keeps_half_the_matmul_outputs():
    from ndparallel.plan.time.recompute_policies import op_policy_saved_per_token

    model = PRESETS["llama-3.1-8b"]  # h 4096, a·d 4096, k·d 1024, f 14336
    s = Settings(sequence_len=8192, activation_checkpointing=True, ac_policy="op")
    # torchtitan's per-op policy: input + q + v + attention out + gate + down, bf16, + fp32 lse
    assert (
        op_policy_saved_per_token(model, ParallelDims(), s)
        == 2 * (4096 + 4096 + 1024 + 4096 + 14336 + 4096) + 4 * 32
    )


def test_selective_policy_keeps_norm_inputs_attention_and_gate_up():
    """The runtime's selective policy (measured equal in tests/test_selective_ac.py): TP 8 + SP,
    per token: two norm inputs and two block inputs (shards, e·h/8 each), q, k, v, the attention
    output, lse, gate and up, and down_proj's reduce-scattered output."""
    from ndparallel.plan.memory.activations import selective_saved_per_token

    model = PRESETS["llama-3.1-8b"]  # h 4096, a 32, k 8, d 128, f 14336
    s = Settings(sequence_len=8192, activation_checkpointing=True, ac_policy="selective")
    per = 2 * (4 * 4096 + (4096 + 2 * 1024) + 4096 + 2 * 14336 + 4096) / 8 + 4 * 32 / 8
    assert selective_saved_per_token(model, ParallelDims(tp=8), s) == per
    assert per < 34 * 4096 / 8  # Megatron's bound


def test_h200_rows_memory():
    """The measured peaks of the H200 runs (bench/reference/h200_plan_gpu_check.json,
    torch.cuda.max_memory_allocated) against ``allocated`` — every row within 1 %."""
    import json
    from pathlib import Path

    from ndparallel.plan.hardware import PRESETS as HWP

    rows = json.loads(
        (Path(__file__).parents[1] / "bench" / "reference" / "h200_plan_gpu_check.json").read_text()
    )["rows"]
    assert len(rows) == 6
    for r in rows:
        s = Settings(
            sequence_len=r["seq"],
            micro_batch_size=r["micro_batch"],
            activation_checkpointing=r["checkpointing"],
            optimizer_fused=r["fused_adamw"],
        )
        m = estimate_memory(PRESETS[r["planner_model"]], ParallelDims(), s, HWP["h200"])
        assert m.allocated / 2**30 == pytest.approx(r["max_allocated_gib"], rel=0.01), r["config"]


def test_the_head_units_reduce_scatter_input_is_held_at_the_last_layer():
    """FSDP2 keeps the previous unit's reduce-scatter input until the next unit's reduce-scatter
    (``reduce_scatter_states``): at the last layer's backward the untied head's, in the reduce
    dtype, larger than a layer's for Llama-3.1-8B; a tied model's root unit reduces at the end."""
    from ndparallel.plan.memory.buffers import fsdp_buffers
    from ndparallel.plan.models import fsdp_units

    lay, s = ParallelDims(dp_shard=8), Settings(sequence_len=4096, mixed_precision="bf16")
    spec = PRESETS["llama-3.1-8b"]
    numels = unit_numels(spec, lay.tp, lay.fsdp, lay)
    layer, head = numels["layer"][0], numels["final"][0]
    assert head > layer and fsdp_units(spec)["final"] == (1, False)
    _, buf_b = fsdp_buffers(spec, lay, s, numels)
    assert buf_b == (1 + s.prefetch) * layer * 2 + layer * 2 + head * 4
    tied = dataclasses.replace(spec, tied_embeddings=True)
    tied_numels = unit_numels(tied, lay.tp, lay.fsdp, lay)
    root = tied_numels["root"][0]
    _, tied_b = fsdp_buffers(tied, lay, s, tied_numels)
    assert tied_b == (1 + s.prefetch) * layer * 2 + layer * (2 + 4) + root * (2 + 2)


def test_selective_layer_backward_holds_one_plain_set():
    """At a layer's backward under the selective policy the layer holds its plain saved set once:
    its kept share (counted with every layer's) and what it recomputes (the rest), never the kept
    share twice (measured: bench/simulate_settings.py)."""
    from ndparallel.plan.memory.activations import backward_workspace, selective_saved_per_token

    s = Settings(
        sequence_len=256,
        micro_batch_size=2,
        activation_checkpointing=True,
        ac_policy="selective",
        chunked_loss=True,
    )
    lay, tokens = ParallelDims(dp_shard=8), 512
    layer_backward, _ = _activation_terms(TINY, lay, s)[0][MOMENTS.index("layer backward")]
    plain = layer_activation_bytes_per_token(TINY, lay, s) * tokens
    kept = selective_saved_per_token(TINY, lay, s) * tokens
    rope = 2 * tokens * TINY.head_dim * s.act_bytes
    assert layer_backward == pytest.approx(
        (TINY.layers - 1) * kept + plain + backward_workspace(TINY, lay, s, tokens) + rope
    )
