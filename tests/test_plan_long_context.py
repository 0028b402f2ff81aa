"""The planner's model of the long-context options (tiled MLP, activation offloading, CP attention
buffers) and ``plan --max-seq-len``: hand-checked formulas, monotonicity, the search's bracket,
the host-memory rejection and the CLI's flags."""

import dataclasses
import json
from pathlib import Path

import pytest

from ndparallel.layout.dims import ParallelDims
from ndparallel.plan.hardware import GiB, get_preset
from ndparallel.plan.memo import clear_memos
from ndparallel.plan.memory.activations import (
    host_bytes,
    mlp_half_saved_per_token,
    norm_backward_per_token,
    norm_backward_stage,
    offload_split_per_token,
    offloaded_attention_half_per_token,
    selective_saved_per_token,
)
from ndparallel.plan.memory.cp_memory import attention_scratch_per_token
from ndparallel.plan.memory.long_context import mlp_tiles
from ndparallel.plan.memory.peak import _activation_terms, estimate_memory
from ndparallel.plan.models import load_model_spec
from ndparallel.plan.search.evaluation import estimate, evaluate_layout
from ndparallel.plan.search.longest import CP_STRATEGIES, longest, longest_any_strategy, longest_for_layout
from ndparallel.plan.search.request import PlanRequest
from ndparallel.plan.settings import Settings
from ndparallel.plan.time.gemm import micro_batch_gemms
from ndparallel.techniques.tile_rule import tile_split

L8B = load_model_spec("llama-3.1-8b")
H100 = get_preset("h100-80gb")


def _mem(layout=ParallelDims(), **kw):
    return estimate_memory(L8B, layout, Settings(**{"sequence_len": 65536, "chunked_loss": True, **kw}), H100)


def test_one_tile_rule():
    """The tiles the runtime cuts, the planner costs and preflight prints: about ``hidden`` tokens
    each, or the configured count, never more than one per token; equal but the last."""
    assert tile_split(65536, 4096) == (16, 4096)
    assert tile_split(100, 32) == (4, 25)
    assert tile_split(32, 8, num_tiles=3) == (3, 11)  # 11 + 11 + 10
    assert tile_split(5, 4096, num_tiles=8) == (5, 1)
    assert mlp_tiles(
        L8B, ParallelDims(tp=4), Settings(sequence_len=65536, tiled_mlp=True, micro_batch_size=2)
    ) == (
        4,
        2 * 4096 * 4,
    )


def test_tiled_mlp_drops_the_mlp_intermediates_of_every_layer():
    # the full logits make the loss backward the peak of both: there every layer's saved set is
    # smaller by gate, SiLU, up, product (4·e·f per token) and by its two lean norms' fp32 copies
    # of their input (2·4·h: techniques/lean_norm.py)
    tokens, e, f, h = 12288, 2, L8B.intermediate, L8B.hidden
    plain, tiled = (_mem(chunked_loss=False, sequence_len=tokens, tiled_mlp=t) for t in (False, True))
    assert plain.peak_phase == tiled.peak_phase == "loss backward"
    assert plain.activations - tiled.activations == pytest.approx(L8B.layers * tokens * (4 * e * f + 8 * h))
    assert _mem(tiled_mlp=True).total < _mem().total
    # tiles: ceil(65536 / 4096) = 16 of 4096 tokens
    assert mlp_tiles(L8B, ParallelDims(), Settings(sequence_len=65536, tiled_mlp=True)) == (16, 4096)
    # under TP 4 + SP the MLP input stays sharded; untiled it is saved as its shard too (the
    # runtime's default) or, with sp_saved_shards off, gathered: then also e·h·(1 - 1/4) less
    lay = ParallelDims(tp=4)
    for shards, input_saving in ((True, 0.0), (False, e * L8B.hidden * 3 / 4)):
        sp, sp_tiled = (
            _mem(
                lay,
                chunked_loss=False,
                sequence_len=tokens,
                tiled_mlp=t,
                sequence_parallel_saved_shards=shards,
            )
            for t in (False, True)
        )
        assert sp.peak_phase == sp_tiled.peak_phase == "loss backward"
        assert sp.activations - sp_tiled.activations == pytest.approx(
            L8B.layers * tokens * (4 * e * f / 4 + input_saving + 8 * h / 4)
        )


def test_tiled_mlp_costs_one_more_mlp_forward():
    s = Settings(sequence_len=32768)
    flops = {
        tiled: sum(
            g.flops for g in micro_batch_gemms(L8B, ParallelDims(), dataclasses.replace(s, tiled_mlp=tiled))
        )
        for tiled in (False, True)
    }
    mlp_forward = 2 * 32768 * 3 * L8B.hidden * L8B.intermediate * L8B.layers
    assert flops[True] - flops[False] == pytest.approx(mlp_forward)


def test_offloading_keeps_two_layer_inputs_on_the_device():
    # LoRA on FSDP 8: small states, the layer backward is the peak of both
    ck, off = (
        _mem(ParallelDims(dp_shard=8), activation_checkpointing=True, activation_offloading=o, lora_r=16)
        for o in (False, True)
    )
    assert ck.peak_phase == off.peak_phase == "layer backward"
    layer_input = 65536 * L8B.hidden * 2
    assert off.host_offload == L8B.layers * layer_input
    assert ck.host_offload == 0
    assert ck.activations - off.activations == pytest.approx((L8B.layers - 2) * layer_input)
    assert (
        host_bytes(
            L8B,
            ParallelDims(cp=4),
            Settings(sequence_len=65536, activation_checkpointing=True, activation_offloading=True),
        )
        == off.host_offload / 4
    )


def test_offload_time_is_exposed_only_beyond_the_compute():
    s = Settings(sequence_len=65536, activation_checkpointing=True, activation_offloading=True)
    fast = estimate(L8B, ParallelDims(), s, H100, 8)
    slow = estimate(L8B, ParallelDims(), s, dataclasses.replace(H100, host_link_bw=1e8), 8)
    assert fast.time.offload_exposed == 0.0
    assert slow.time.offload_exposed > 0 and slow.time.step > fast.time.step


def _selective(layout, **kw):
    s = Settings(
        **{
            "sequence_len": 8192,
            "chunked_loss": True,
            "activation_checkpointing": True,
            "ac_policy": "selective",
            **kw,
        }
    )
    return estimate_memory(L8B, layout, s, H100), s


def test_selective_offloading_keeps_the_residue_on_the_device():
    """Selective checkpointing with offloading: every tensor a layer saves goes to host memory but,
    under TP, the output of down_proj's collective (``e·h/t_sp``); in backward one layer's set is
    back on the device. ``selective_saved_per_token`` is the measured saved set."""
    tokens, e, h = 8192, 2, L8B.hidden
    # TP 8 + FSDP 8: the loss backward is the peak of both, where only the saved sets differ
    lay = ParallelDims(tp=8, dp_shard=8)
    (kept, s), (off, s_off) = (_selective(lay, activation_offloading=o) for o in (False, True))
    saved, residue = selective_saved_per_token(L8B, lay, s), e * h / 8
    assert offload_split_per_token(L8B, lay, s_off) == (residue, saved - residue)
    assert offload_split_per_token(L8B, lay, s) == (0.0, 0.0)
    assert kept.peak_phase == off.peak_phase == "loss backward"
    assert kept.activations - off.activations == pytest.approx(L8B.layers * tokens * (saved - residue))
    rope = tokens * 2 * e * L8B.head_dim  # cos and sin, saved by every layer, offloaded once
    assert off.host_offload == pytest.approx(L8B.layers * tokens * (saved - residue) + rope)
    assert kept.host_offload == 0
    # FSDP 8 alone: no residue (no TP); at the layer backward one layer's saved set is restored
    lay = ParallelDims(dp_shard=8)
    (kept, s), (off, s_off) = (_selective(lay, activation_offloading=o) for o in (False, True))
    saved = selective_saved_per_token(L8B, lay, s)
    assert offload_split_per_token(L8B, lay, s_off) == (0.0, saved)
    assert kept.peak_phase == "layer backward"  # offloaded, the embedding's backward is larger
    (kept_acts, _), (off_acts, _) = (_activation_terms(L8B, lay, x)[0][1] for x in (s, s_off))
    assert kept.activations == kept_acts
    # ... but its attention half, back only when the attention's backward starts: not in the MLP's
    later = offloaded_attention_half_per_token(L8B, lay, s_off)
    assert 0 < later < saved
    assert kept_acts - off_acts == pytest.approx((L8B.layers - 1) * tokens * saved + tokens * later)


def test_host_memory_holds_every_micro_batch_in_flight():
    """Host bytes are the offloaded bytes of each micro-batch in flight (a pipeline rank's
    ``pp_in_flight``), under both checkpointing policies (selective: with RoPE's cos and sin)."""
    for policy in ("full", "selective"):
        host = [
            _selective(ParallelDims(tp=8), activation_offloading=True, ac_policy=policy, pp_in_flight=k)[
                0
            ].host_offload
            for k in (1.0, 2.0, 18.5)
        ]
        s = Settings(
            sequence_len=8192, activation_checkpointing=True, ac_policy=policy, activation_offloading=True
        )
        per_layer = 8192 * offload_split_per_token(L8B, ParallelDims(tp=8), s)[1]
        rope = 8192 * 2 * 2 * L8B.head_dim if policy == "selective" else 0
        assert host == pytest.approx([k * (L8B.layers * per_layer + rope) for k in (1.0, 2.0, 18.5)]), policy
        assert host[0] == host_bytes(L8B, ParallelDims(tp=8), s)


def test_full_checkpointing_offload_copies_in_flight_are_a_bound_per_rank():
    """With full checkpointing the offloader keeps at most ``offload_in_flight`` layer inputs on the
    device at any moment, whatever the micro-batches in flight: each more micro-batch adds only its
    own device tensors (RoPE's cos and sin here), not two more layer inputs."""
    seq = 131072  # the layer backward is the peak (at 8,192 the optimizer step is)
    mems = [
        _selective(
            ParallelDims(pp=2, tp=8),
            activation_offloading=True,
            ac_policy="full",
            pp_in_flight=k,
            sequence_len=seq,
        )[0]
        for k in (1.0, 18.5)
    ]
    assert mems[0].peak_phase == mems[1].peak_phase == "layer backward"
    rope = seq * 2 * 2 * L8B.head_dim
    assert mems[1].activations - mems[0].activations == pytest.approx(17.5 * rope)


def test_selective_offload_time_against_a_third_of_the_compute():
    """Selective checkpointing recomputes no whole layer: a layer's device→host copy hides behind
    its forward (a third of its compute), the host→device copy behind its backward (two thirds).
    A copy half a layer's compute long is exposed by a sixth of it, once per layer and micro-batch."""
    lay = ParallelDims(tp=8)
    s = Settings(
        sequence_len=8192,
        activation_checkpointing=True,
        ac_policy="selective",
        activation_offloading=True,
        gradient_accumulation_steps=2,
    )
    fast = estimate(L8B, lay, s, dataclasses.replace(H100, host_link_bw=1e15), 8)
    assert fast.time.offload_exposed == 0.0
    layer_compute = fast.time.compute_parts["total"] / L8B.layers
    copy_bytes = 8192 * offload_split_per_token(L8B, lay, s)[1]
    half = estimate(L8B, lay, s, dataclasses.replace(H100, host_link_bw=copy_bytes / (layer_compute / 2)), 8)
    assert half.time.offload_exposed == pytest.approx(2 * L8B.layers * layer_compute / 6)
    tiny = estimate(L8B, lay, s, dataclasses.replace(H100, host_link_bw=1e8), 8)
    assert tiny.time.offload_exposed > half.time.offload_exposed and tiny.time.step > fast.time.step


def test_ring_attention_buffers_are_in_the_layer_backward():
    lay = ParallelDims(cp=8)
    a_d, kv = L8B.heads * L8B.head_dim, L8B.kv_heads * L8B.head_dim
    s = Settings(sequence_len=1 << 20, activation_checkpointing=True, tiled_mlp=True)
    assert attention_scratch_per_token(L8B, lay, s) == 4 * a_d + 4 * 2 * kv + 24 * kv + 2 * a_d
    assert attention_scratch_per_token(L8B, ParallelDims(), s) == 0.0


def test_attention_stage_no_longer_holds_the_mlp_half(monkeypatch):
    # by the attention's backward the post-attention norm's tensors (tiled: the lean norm's bf16
    # input and reciprocal RMS; untiled: HF's fp32 input, bf16 output, reciprocal RMS) and the
    # tiled MLP's saved input are freed: 2·h + 4 + 2·h per token tiled
    lay, h, e = ParallelDims(cp=8), L8B.hidden, 2
    s = Settings(sequence_len=1 << 20, activation_checkpointing=True, tiled_mlp=True, cp_comm_strategy="ring")
    half = e * h + 4 + e * h
    assert mlp_half_saved_per_token(L8B, lay, s) == half
    untiled = dataclasses.replace(s, tiled_mlp=False)
    assert mlp_half_saved_per_token(L8B, lay, untiled) == (4 + e) * h + 4 + e * h + 4 * e * L8B.intermediate
    # the selective policy holds the same half, kept or recomputed; under TP also the output of
    # down_proj's collective it keeps; the op policy and MoE blocks: not modelled (0)
    selective = dataclasses.replace(untiled, ac_policy="selective")
    assert mlp_half_saved_per_token(L8B, lay, selective) == mlp_half_saved_per_token(L8B, lay, untiled)
    # under TP 8 with sequence parallel: the norm's and its input's, the MLP input's shards, gate, up,
    # SiLU, the product, and the collective's output
    with_residue = ((4 + e) * h + 4) / 8 + e * h / 8 + 4 * e * L8B.intermediate / 8 + e * h / 8
    assert mlp_half_saved_per_token(L8B, ParallelDims(tp=8), selective) == pytest.approx(with_residue)
    assert mlp_half_saved_per_token(L8B, lay, dataclasses.replace(untiled, ac_policy="op")) == 0.0
    # the lean norm's stage is one tile: the ring's buffers are the larger stage, and the
    # layer-backward moment is smaller by exactly the MLP half
    now = _mem(lay, sequence_len=1 << 20, activation_checkpointing=True, tiled_mlp=True)
    monkeypatch.setattr("ndparallel.plan.memory.activations.mlp_half_saved_per_token", lambda *a: 0.0)
    clear_memos()  # the micro-batch's memory terms are memoised (plan/memo.py): again, patched
    upper_bound = _mem(lay, sequence_len=1 << 20, activation_checkpointing=True, tiled_mlp=True)
    clear_memos()  # and none of the patched ones kept for the tests after this one
    assert now.peak_phase == upper_bound.peak_phase == "layer backward"
    assert upper_bound.activations - now.activations == pytest.approx((1 << 20) / 8 * half)


def test_norm_backward_stage_hf_untiled_lean_tiled(monkeypatch):
    # HF's RMSNorm backward in fp32 (untiled): five [T, h] fp32 tensors inside pow's backward
    # (20·h), the MLP half freed but the norm's fp32 input, one residual-stream gradient less (e·h);
    # gate/up/product freed by then outweigh it: the MLP stage stays the larger
    lay, h, e, tokens = ParallelDims(cp=8), L8B.hidden, 2, (1 << 20) / 8
    untiled = Settings(sequence_len=1 << 20, activation_checkpointing=True, cp_comm_strategy="ring")
    half = (4 + e) * h + 4 + e * h + 4 * e * L8B.intermediate
    norm = 20 * h - (half - 4 * h) - e * h
    assert norm_backward_per_token(L8B, lay, untiled) == norm < 3 * e * L8B.intermediate
    assert norm_backward_stage(L8B, lay, untiled, tokens) == tokens * norm
    # tiled, the lean norm (techniques/lean_norm.py): four fp32 [tile, h] tensors, tile = h tokens
    # of the 131,072 local ones; not the layer's largest stage (patching it out changes nothing)
    s = dataclasses.replace(untiled, tiled_mlp=True)
    assert norm_backward_stage(L8B, lay, s, tokens) == 16 * h * h
    sp = Settings(sequence_len=1 << 20, activation_checkpointing=True, tiled_mlp=True, sequence_parallel=True)
    assert norm_backward_stage(L8B, ParallelDims(tp=2), sp, tokens) == 16 * h * h  # 524,288 rows, tiles of h
    now = _mem(lay, sequence_len=1 << 20, activation_checkpointing=True, tiled_mlp=True)
    monkeypatch.setattr("ndparallel.plan.memory.activations.norm_backward_stage", lambda *a: 0.0)
    clear_memos()  # the micro-batch's memory terms are memoised (plan/memo.py): again, patched
    without = _mem(lay, sequence_len=1 << 20, activation_checkpointing=True, tiled_mlp=True)
    clear_memos()  # none of the patched ones kept for the tests after this one
    assert now.peak_phase == without.peak_phase == "layer backward"
    assert now.activations == without.activations


def test_host_memory_rejects_what_does_not_fit_the_node():
    req = PlanRequest.of(
        L8B,
        H100,
        8,
        sequence_len=1 << 20,
        micro_batch_size=1,
        global_batch_size=1,
        activation_offloading=True,
        tiled_mlp=True,
    )
    ok = evaluate_layout(req, ParallelDims(cp=8))
    assert ok.ok, ok.rejections
    tight = evaluate_layout(req.updated(host_mem_bytes=64 * GiB), ParallelDims(cp=8))
    assert not tight.ok and tight.rejections[0][0] == "host_oom", tight.rejections


@pytest.mark.parametrize(
    "flags, host_mem, preset",
    [
        (["--gpu", "h100-80gb"], 2048 * GiB, True),  # DGX H100
        (["--gpu", "a100-40gb"], 1024 * GiB, True),  # DGX A100 320 GB
        (["--gpu", "h100-80gb", "--host-mem", "8TB"], 8192 * GiB, False),
    ],
)
def test_host_memory_defaults_to_the_presets_node(flags, host_mem, preset):
    """Without --host-mem the GPU preset's typical node bounds offloading (``host_oom`` beyond 80 %
    of it), said in the header and the rejection; --host-mem overrides it. Llama-3.1-8B's 1M tokens
    at CP 8, selective and offloaded, need ~3.4 TiB of host memory per node."""
    from ndparallel.plan.cli.from_flags import build_request, run_values
    from ndparallel.plan.cli.parser import parse
    from ndparallel.plan.cli.report import header
    from ndparallel.plan.search.request import PlanResult

    args = parse(["--base-model", "llama-3.1-8b", "--gpus", "8", *flags])
    req = build_request(args, run_values(args))
    assert (req.host_mem_bytes, req.host_mem_preset) == (host_mem, preset)
    said = header(PlanResult(req, [], []))
    assert ("preset's" in said) == preset and f"{host_mem / GiB:.0f} GiB" in said
    pinned = dict(
        activation_checkpointing="on", ac_policy="selective", activation_offloading=True, tiled_mlp=True
    )
    long = req.updated(sequence_len=1 << 20, micro_batch_size=1, global_batch_size=1, **pinned)
    unbounded = evaluate_layout(long.updated(host_mem_bytes=None), ParallelDims(cp=8))
    need = 8 * unbounded.best.memory.host_offload
    assert 0.8 * 2048 * GiB < need < 0.8 * 8192 * GiB, need / GiB
    res = evaluate_layout(long, ParallelDims(cp=8))
    assert res.ok == (need <= 0.8 * host_mem), res.rejections
    if not res.ok:
        assert res.rejections[0][0] == "host_oom" and "preset's" in res.rejections[0][1], res.rejections


def test_longest_brackets_the_answer_and_the_options_add_up():
    req = PlanRequest.of(L8B, H100, 8, tiled_mlp=True, activation_offloading=True)
    lay = ParallelDims(cp=8)
    got = longest_for_layout(req, lay)
    assert got.sequence_len > 2_000_000 and got.sequence_len % 16 == 0
    fits = [
        evaluate_layout(req.updated(sequence_len=n, micro_batch_size=1, global_batch_size=1), lay).ok
        for n in (got.sequence_len, got.sequence_len + 16 * (1 + got.sequence_len // 16 // 100))
    ]
    assert fits == [True, False]
    lengths = [
        longest_for_layout(req.updated(tiled_mlp=t, activation_offloading=o), lay).sequence_len
        for t, o in ((False, False), (True, False), (False, True), (True, True))
    ]
    assert lengths[0] < lengths[1] < lengths[3] and lengths[0] < lengths[2] < lengths[3], lengths
    assert longest_for_layout(req, ParallelDims(tp=8)).sequence_len > 0  # heads 32 / kv 8: tp 8 runs
    assert longest_for_layout(req, ParallelDims(tp=8 * 2), 1 << 20).reason  # tp beyond the kv heads


def test_longest_tries_every_cp_strategy():
    """Each CP layout keeps the strategy that trains the longest (the ring's shards, all-gathered
    K/V, Ulysses' head all-to-all hold different buffers); a layout without CP is searched once."""
    req = PlanRequest.of(L8B, H100, 8, tiled_mlp=True, activation_offloading=True)
    lay = ParallelDims(cp=8)
    each = {n: longest_for_layout(req.updated(cp_comm_strategy=n), lay).sequence_len for n in CP_STRATEGIES}
    got = longest_any_strategy(req, lay, CP_STRATEGIES)
    assert got.sequence_len == max(each.values()) and got.best.settings.cp_comm_strategy == max(
        each, key=each.get
    )
    assert len(set(each.values())) > 1, each  # the choice matters here
    assert longest_any_strategy(req, ParallelDims(tp=8), CP_STRATEGIES).sequence_len == (
        longest_for_layout(req, ParallelDims(tp=8)).sequence_len
    )


def test_cli_max_seq_len_pins_the_cp_strategy_when_given(capsys):
    base = ["--base-model", "llama-3.1-8b", "--gpus", "8", "--gpu", "h100-80gb", "--max-seq-len", "--json"]
    base += ["--tiled-mlp", "--activation-offloading"]
    free = json.loads(_plan(capsys, *base)[1])["longest"][0]
    ring = json.loads(_plan(capsys, *base, "--cp-comm-strategy", "ring")[1])["longest"][0]
    req = PlanRequest.of(L8B, H100, 8, tiled_mlp=True, activation_offloading=True)
    req = req.updated(host_mem_bytes=H100.host_mem_per_node)  # no --host-mem: the preset's node
    assert ring["max_seq_len"] == max(r.sequence_len for r in longest(req))  # ring: the request's own
    assert free["max_seq_len"] == max(r.sequence_len for r in longest(req, strategies=CP_STRATEGIES))
    assert free["max_seq_len"] > ring["max_seq_len"]


def _plan(capsys, *argv):
    from ndparallel.plan.cli.main import main

    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_cli_max_seq_len_json(capsys):
    code, out, _ = _plan(
        capsys,
        "--base-model",
        "llama-3.2-1b",
        "--gpus",
        "2",
        "--gpu",
        "h100-80gb",
        "--max-seq-len",
        "--tiled-mlp",
        "--activation-offloading",
        "--json",
    )
    assert code == 0
    data = json.loads(out)
    assert data["longest"][0]["max_seq_len"] > 0
    assert set(data["summary"]) == {"plain", "tiled MLP", "offloading", "tiled MLP + offloading"}


@pytest.mark.parametrize(
    "argv, says",
    [
        (["--tiled-mlp-num-shards", "4"], "--tiled-mlp-num-shards needs --tiled-mlp"),
        (["--activation-offloading", "--activation-checkpointing", "off"], "--activation-offloading"),
        (["--host-mem", "3MB"], "--host-mem"),
        (["--max-seq-len", "--explain", "1x1x1x2"], "--max-seq-len"),
    ],
)
def test_cli_bad_flags(capsys, argv, says):
    code, _, err = _plan(capsys, "--base-model", "llama-3.2-1b", "--gpus", "2", *argv)
    assert code == 2 and says in err and err.count("\n") == 1, err


def test_config_options_reach_the_plan_and_come_back(capsys, tmp_path):
    """``plan --config`` of the long-context example plans with its options; --write-config keeps them."""

    import yaml

    from cli_helpers import run_cli
    from ndparallel.axolotl import load_config

    example = str(Path(__file__).resolve().parents[1] / "examples/gpu/llama-3.1-8b-long-context.yaml")
    code, out, err = run_cli(capsys, "plan", "--config", example, "--gpus", "8", "--json")
    assert code == 0, err
    req = json.loads(out)["request"]
    assert (req["tiled_mlp"], req["activation_offloading"], req["activation_checkpointing"]) == (
        True,
        True,
        "on",
    )
    written = tmp_path / "planned.yaml"
    code, _, err = run_cli(
        capsys, "plan", "--config", example, "--gpus", "8", "--top", "1", "--write-config", str(written)
    )
    assert code == 0, err
    planned = yaml.safe_load(written.read_text())
    assert planned["tiled_mlp"] is True and planned["activation_offloading"] is True
    assert load_config(str(written)).activation_options().activation_offloading
