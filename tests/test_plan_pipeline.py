"""Pipeline parallel in the planner (``plan/pipeline/schedule_model.py``,
``plan/pipeline/pipeline_estimate.py``): the
schedules' bubble and in-flight micro-batches, what each stage holds, the search, the outputs,
and the anchors — Llama-3.1-405B on Meta's layout, Llama-3.1-8B on one node."""

import pytest
import yaml
from rich.console import Console

from ndparallel.layout.dims import ParallelDims
from ndparallel.plan.cli.main import main
from ndparallel.plan.cli.report import print_explain, train_config
from ndparallel.plan.hardware import PRESETS as HW
from ndparallel.plan.memory.activations import offloaded_attention_half_per_token, selective_saved_per_token
from ndparallel.plan.memory.peak import estimate_memory
from ndparallel.plan.models import PRESETS
from ndparallel.plan.pipeline.schedule_model import (
    bubble_fraction,
    in_flight,
    p2p_bytes,
    rank_model,
    rank_shape,
)
from ndparallel.plan.search.evaluation import evaluate_layout, plan
from ndparallel.plan.search.layouts import enumerate_layouts, pipeline_degrees
from ndparallel.plan.search.request import PlanRequest, PlanResult
from ndparallel.plan.settings import Settings

H100 = HW["h100-80gb"]
L405 = PRESETS["llama-3.1-405b"]
META = ParallelDims(dp_shard=64, tp=8, pp=16)
"""Llama 3 paper, table 4: 8192 H100, TP 8, CP 1, PP 16, DP 64 (FSDP), seq 8192, 16M tokens per
step (2048 sequences, 32 per dp rank at micro-batch 1): 430 TFLOP/s per GPU, 43 % BF16 MFU."""
META_MFU = 0.43


def _req(model="llama-3.1-8b", gpus=8, **kw):
    kw.setdefault("gpus_per_node", min(8, gpus))
    return PlanRequest.of(PRESETS[model], kw.pop("hardware", H100), gpus, **kw)


# ------------------------------------------------------------------ formulas
def test_bubble_fraction_by_schedule():
    assert bubble_fraction("1F1B", 1, 8) == 0.0
    assert bubble_fraction("GPipe", 4, 8) == bubble_fraction("1F1B", 4, 8) == pytest.approx(3 / 11)
    assert bubble_fraction("1F1B", 16, 32, v=4) == pytest.approx(15 / 47)  # v ignored: one stage per rank
    assert bubble_fraction("Interleaved1F1B", 16, 32, 2) == pytest.approx(15 / 79)
    assert bubble_fraction("Interleaved1F1B", 4, 8, 4) == pytest.approx(3 / 35)
    assert (
        bubble_fraction("InterleavedZeroBubble", 16, 32, 2)
        == bubble_fraction("ZBVZeroBubble", 4, 8, 2)
        == 0.0
    )


def test_in_flight_micro_batches_by_schedule():
    p, m = 4, 8
    assert [in_flight("1F1B", p, m, 1, r) for r in range(p)] == [4, 3, 2, 1]  # p − stage
    assert in_flight("1F1B", p, 2, 1, 0) == 2  # never more than the step has
    assert [in_flight("GPipe", p, m, 1, r) for r in range(p)] == [8] * 4
    # Interleaved 1F1B, v = 2: (v−1)·p + 2·(p−1−r) + 1 chunks of half the rank's layers
    assert [in_flight("Interleaved1F1B", p, m, 2, r) for r in range(p)] == [5.5, 4.5, 3.5, 2.5]
    v = 2  # rank 0 = (1 + (p−1)/(p·v))·p (Korthikanti et al. 2022)
    assert in_flight("Interleaved1F1B", 16, 32, v, 0) == pytest.approx((1 + 15 / (16 * v)) * 16)
    assert in_flight("ZBVZeroBubble", p, m, 2, 3) == p  # 1F1B's first-stage peak on every rank


def test_in_flight_equals_torch_warmup():
    """The interleaved counts are torch's own warm-up (``_get_warmup_ops``) plus the steady state's
    one forward: a torch change of its schedule shows here."""
    schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
    warmup = getattr(schedules, "_get_warmup_ops", None)
    if warmup is None:
        pytest.skip("torch has no _get_warmup_ops")
    for p, m, v in ((4, 8, 2), (16, 32, 2), (8, 16, 4)):
        for r in range(p):
            per_round = m // max(1, m // p)
            assert in_flight("Interleaved1F1B", p, m, v, r) * v == warmup(r, v, per_round, p, m, 2) + 1
            assert in_flight("InterleavedZeroBubble", p, m, v, r) * v == warmup(r, v, per_round, p, m, 1) + 1


def test_stages_follow_the_runtime_split():
    first, last = rank_shape(L405, 16, 1, "1F1B", 0), rank_shape(L405, 16, 1, "1F1B", 15)
    assert (first.layers, first.first, first.last) == (8, True, False)  # 126 = 14·8 + 2·7
    assert (last.layers, last.first, last.last) == (7, False, True)
    # Interleaved, 32 stages of 4 (the last two 3): rank 0 runs stages 0 and 16, rank 15 15 and 31
    assert rank_shape(L405, 16, 2, "Interleaved1F1B", 0).layers == 8
    assert rank_shape(L405, 16, 2, "Interleaved1F1B", 15).layers == 7
    zbv = rank_shape(L405, 16, 2, "ZBVZeroBubble", 0)
    assert zbv.first and zbv.last and zbv.stages == 2


def test_first_stage_has_the_embedding_last_the_head():
    model = PRESETS["llama-3.1-8b"]
    first = rank_model(model, rank_shape(model, 2, 1, "1F1B", 0))
    last = rank_model(model, rank_shape(model, 2, 1, "1F1B", 1))
    layer, table = model.layer_params, model.vocab * model.hidden
    assert first.num_params == 16 * layer + table
    assert last.num_params == 16 * layer + table + model.hidden  # LM head + final norm
    assert first.num_params + last.num_params == model.num_params
    tied = PRESETS["llama-3.2-1b"]  # tied embeddings: a copy at each end (the runtime's)
    ends = [rank_model(tied, rank_shape(tied, 2, 1, "1F1B", r)) for r in (0, 1)]
    assert sum(m.num_params for m in ends) == tied.num_params + tied.vocab * tied.hidden
    s = Settings(sequence_len=4096, micro_batch_size=1, gradient_accumulation_steps=8, chunked_loss=True)
    mem_first, mem_last = (estimate_memory(m, ParallelDims(pp=2), s, H100) for m in (first, last))
    assert mem_first.logits == 0 and mem_last.logits > 0  # the loss lives on the last stage only
    assert mem_first.params == pytest.approx((16 * layer + table) * 4)


def test_activations_scale_with_the_micro_batches_in_flight():
    model = rank_model(L405, rank_shape(L405, 16, 1, "1F1B", 0))
    acts = [
        estimate_memory(
            model,
            META,
            Settings(
                sequence_len=8192,
                gradient_accumulation_steps=32,
                activation_checkpointing=True,
                pp_in_flight=k,
            ),
            H100,
        ).activations
        for k in (1.0, 2.0, 3.0)
    ]
    assert acts[1] - acts[0] == pytest.approx(acts[2] - acts[1]) and acts[1] > acts[0]  # linear in k


def test_p2p_bytes_and_links():
    s = Settings(sequence_len=8192, micro_batch_size=1, gradient_accumulation_steps=32)
    assert (
        p2p_bytes(L405, ParallelDims(dp_shard=64, tp=8, pp=16), s) == 8192 * 16384 * 2 // 8
    )  # ÷ tp under SP
    no_sp = Settings(sequence_len=8192, sequence_parallel=False)
    assert p2p_bytes(L405, ParallelDims(tp=8, pp=2, cp=2), no_sp) == 4096 * 16384 * 2
    e = evaluate_layout(
        _req("llama-3.1-70b", 64, sequence_len=8192, global_batch_size=64),
        ParallelDims(dp_shard=8, pp=8),
        micro_batch_size=1,
        activation_checkpointing=True,
    ).best
    sends = [c for c in e.collectives if c.mesh_dim == "pp"]
    assert sends and all(c.kind == "send_recv" for c in sends)
    assert e.time.comm_total["pp"]["intra_node"] is False  # stages 8 ranks apart: one node each


# ------------------------------------------------------------------ search
def test_search_enumerates_pipeline_degrees():
    assert pipeline_degrees(8192, 126) == [1, 2, 4, 8, 16, 32, 64]
    assert pipeline_degrees(24, 126) == [1, 2, 4, 8]
    assert pipeline_degrees(64, 4) == [1, 2, 4]
    lays = enumerate_layouts(16, layers=32)
    assert {lay.pp for lay in lays} == {1, 2, 4, 8, 16} and all(lay.world == 16 for lay in lays)
    assert enumerate_layouts(16) == [lay for lay in lays if lay.pp == 1]  # no layers: no PP
    assert {lay.pp for lay in enumerate_layouts(16, experts=8, layers=32)} == {1}


def test_pipeline_rejections_are_one_line():
    req = _req(
        gpus=16, sequence_len=4096, global_batch_size=16, micro_batch_size=2
    )  # dp 2 × mb 2: m = 4 < 8 stages
    res = evaluate_layout(req, ParallelDims(dp_shard=2, pp=8))
    assert [c for c, _ in res.rejections] == ["pp_microbatches"]
    assert "4 pipeline micro-batch(es) per step for 8 pipeline stages" in res.rejections[0][1]
    assert "\n" not in res.rejections[0][1]
    tiny = PRESETS["tiny"]
    deep = 2 * tiny.layers
    assert "pp_layers" in [
        c for c, _ in evaluate_layout(_req("tiny", deep), ParallelDims(pp=deep)).rejections
    ]
    lora = evaluate_layout(_req(gpus=16, lora_r=16), ParallelDims(dp_shard=8, pp=2))
    assert [c for c, _ in lora.rejections] == ["pp_adapter"]
    # m = 6 is no multiple of pp = 4: the interleaved schedule is skipped, 1F1B stays
    res = evaluate_layout(
        _req(gpus=16, global_batch_size=24, micro_batch_size=1), ParallelDims(dp_shard=4, pp=4)
    )
    assert res.ok and {o.settings.pipeline_schedule for o in res.options} == {"1F1B"}


def test_8b_on_one_node_does_not_pick_pipeline_parallel():
    result = plan(_req(gpus=8, sequence_len=8192))
    assert result.ranked[0].layout.pp == 1
    assert any(r.layout.pp > 1 for r in result.ranked)  # PP layouts were ranked, just slower


def test_hsdp_replicas_all_reduce_every_pipeline_micro_batch():
    """By default the pipeline runtime never skips FSDP's gradient sync: every micro-batch
    reduce-scatters and all-reduces across replicas (without PP: once per step)."""
    req = _req("llama-3.1-70b", 64, sequence_len=4096, global_batch_size=64)
    pp = evaluate_layout(
        req,
        ParallelDims(dp_replicate=2, dp_shard=4, pp=8),
        micro_batch_size=1,
        activation_checkpointing=True,
        unsharded_grad_accumulation=False,
    ).best
    flat = evaluate_layout(
        req, ParallelDims(dp_replicate=2, dp_shard=4, tp=8), micro_batch_size=1, activation_checkpointing=True
    ).best
    replica = {c.what: c.count for c in pp.collectives if c.mesh_dim == "dp_replicate"}
    assert replica.pop("HSDP all-reduce grads (layer)") == 10 * 8  # 10 layers × m = 8
    assert list(replica.values()) == [8]  # the stage's embedding or its LM head, every micro-batch
    assert flat.settings.gradient_accumulation_steps == 8
    assert {c.what: c.count for c in flat.collectives if c.mesh_dim == "dp_replicate"} == {
        "HSDP all-reduce grads (layer)": 80,
        "HSDP all-reduce grads (embed)": 1,
        "HSDP all-reduce grads (final)": 1,
    }


def test_unsharded_accumulation_under_pp_reduces_and_gathers_once_per_step():
    """With unsharded_grad_accumulation each stage is torch's FSDP root: one reduction per step
    (HSDP's all-reduce too), the parameters kept gathered between micro-batches — one gather per
    step, ga + 1 with resharding after forward (a unit's op after a forward gathers again) — and
    a full fp32 gradient of the stage per rank. The counts are the runtime's:
    tests/test_pipeline_equivalence.py counts the reductions, docs/planner.md the gathers."""
    req = _req("llama-3.1-70b", 64, sequence_len=4096, global_batch_size=64)
    lay, m = ParallelDims(dp_replicate=2, dp_shard=4, pp=8), 8

    def option(unsharded, **kw):
        (only,) = evaluate_layout(
            req.updated(**{"reshard_after_forward": True, **kw}),
            lay,
            micro_batch_size=1,
            activation_checkpointing=True,
            ac_policy="full",
            activation_offloading=False,
            tiled_mlp=False,
            pipeline_schedule="1F1B",
            unsharded_grad_accumulation=unsharded,
        ).options
        return only  # fitting or not: the counts are the question

    def counts(e, kind, what="(layer)"):
        return sum(c.count for c in e.collectives if c.kind == kind and what in c.what)

    every, once = option(False), option(True)
    layers = rank_shape(PRESETS["llama-3.1-70b"], 8, 1, "1F1B", 0).layers
    assert counts(every, "reduce_scatter") == layers * m and counts(once, "reduce_scatter") == layers
    assert counts(every, "all_reduce") == layers * m and counts(once, "all_reduce") == layers
    assert counts(every, "all_gather") == 2 * layers * m and counts(once, "all_gather") == layers * (m + 1)
    kept = option(True, reshard_after_forward=False)
    assert (
        counts(kept, "all_gather") == layers
        and counts(option(False, reshard_after_forward=False), "all_gather") == layers * m
    )
    first = rank_model(PRESETS["llama-3.1-70b"], rank_shape(PRESETS["llama-3.1-70b"], 8, 1, "1F1B", 0))
    assert (
        once.memory.grads == 4 * first.num_params
    )  # tp = 1: the stage's unsharded fp32 gradients, no shard yet
    assert once.time.dp_exposed < every.time.dp_exposed
    assert (
        once.settings.unsharded_grad_accumulation
        and train_config(once, plan(_req("llama-3.2-1b", 1)))["fsdp_config"]["unsharded_grad_accumulation"]
        is True
    )


# ------------------------------------------------------------------ outputs
def test_explain_prints_bubble_and_stage_memory(capsys):
    args = [
        "--base-model",
        "llama-3.1-70b",
        "--gpus",
        "64",
        "--sequence-len",
        "4096",
        "--global-batch-size",
        "64",
        "--explain",
        "pp8:1x8x1x1,mb=1,ac=on,schedule=Interleaved1F1B,uga=on",
    ]
    assert main(args) == 0
    out = capsys.readouterr().out
    bubble = [line for line in out.splitlines() if line.startswith("Pipeline ")]
    assert len(bubble) == 1 and "Interleaved1F1B" in bubble[0] and f"{7 / 23:.1%}" in bubble[0]
    assert "reduced once per step" in bubble[0]
    assert main(args[:-1] + [args[-1].replace("uga=on", "uga=maybe")]) == 2
    memory = [line for line in out.splitlines() if line.startswith("Stage memory:")]
    assert len(memory) == 1 and "first (" in memory[0] and "last (" in memory[0] and "GiB" in memory[0]


def test_write_config_has_the_pipeline_fields(tmp_path):
    req = _req("llama-3.1-70b", 64, sequence_len=4096, global_batch_size=64)
    res = evaluate_layout(
        req,
        ParallelDims(dp_shard=8, pp=8),
        micro_batch_size=1,
        pipeline_schedule="Interleaved1F1B",
        pipeline_virtual_stages=4,
    )
    cfg = train_config(res.best, plan(_req("llama-3.2-1b", 1)))
    assert (cfg["pipeline_parallel_size"], cfg["pipeline_schedule"], cfg["pipeline_virtual_stages"]) == (
        8,
        "Interleaved1F1B",
        4,
    )
    assert "pipeline_microbatches" not in cfg  # the runtime's default: one per accumulation step
    assert cfg["dp_shard_size"] * cfg["pipeline_parallel_size"] == 64
    from ndparallel.config import TrainConfig

    TrainConfig.model_validate(cfg)
    out = tmp_path / "pp.yaml"
    assert (
        main(
            [
                "--base-model",
                "llama-3.1-70b",
                "--gpus",
                "64",
                "--sequence-len",
                "4096",
                "--global-batch-size",
                "64",
                "--explain",
                "pp=8,ds=8,mb=1,schedule=1F1B",
                "--write-config",
                str(out),
            ]
        )
        == 0
    )
    written = yaml.safe_load(out.read_text())
    assert (written["pipeline_parallel_size"], written["pipeline_schedule"]) == (8, "1F1B")
    assert "pipeline_virtual_stages" not in written


# ------------------------------------------------------------------ anchors
META_SETTINGS = dict(
    micro_batch_size=1,
    activation_checkpointing=False,
    pipeline_schedule="Interleaved1F1B",
    unsharded_grad_accumulation=True,
    tiled_mlp=False,
)
"""Meta's run as the Llama 3 paper (§3.3.2) describes it: FSDP not resharding after forward (the
request's ``reshard_after_forward=False``), gradients accumulated in fp32 over the micro-batches
and reduce-scattered once per step, no activation checkpointing at 8K tokens, interleaved 1F1B."""


@pytest.fixture(scope="module")
def meta_run():
    """Meta's layout under Meta's settings at v = 2 (ndparallel's default) and v = 7 (the deepest
    ndparallel splits 126 layers over 16 ranks; Meta's chunks were one layer each, V = 8), the
    same layout with every setting left to the search (no setting flag: issue 61), and the
    planner's own search of the same request."""
    req = _req("llama-3.1-405b", 8192, sequence_len=8192, global_batch_size=2048, reshard_after_forward=False)
    meta = {v: evaluate_layout(req, META, pipeline_virtual_stages=v, **META_SETTINGS) for v in (2, 7)}
    free = _req("llama-3.1-405b", 8192, sequence_len=8192, global_batch_size=2048)
    return meta, evaluate_layout(free, META, skip_unfit=True), plan(free)


@pytest.mark.parametrize("v", [2, 7])
def test_405b_meta_layout_within_15_percent(meta_run, v, capsys):
    """Under Meta's settings the prediction is within 15 % of the 43 % measured (2026-12-06: 37.5 %
    at v = 2, 40.8 % at v = 7) — and it does not fit ndparallel's runtime, which keeps ~95 KB per
    token and layer at tp 8 without checkpointing (sequence parallel saves each block's shard):
    --explain says so in one line, with the time prediction beside it."""
    meta, _, result = meta_run
    res = meta[v]
    (e,) = res.options
    assert abs(e.mfu / META_MFU - 1) <= 0.15, e.mfu
    assert not e.fits and not res.ok and res.rejections[0][0] == "oom"
    assert e.settings.gradient_accumulation_steps == 32 and e.pipeline.bubble_fraction == pytest.approx(
        15 / (32 * v + 15)
    )
    assert e.time.dp_exposed < e.time.pp_bubble + e.time.tp_exposed  # FSDP once per step: small
    print_explain(res, result, Console(width=200))
    out = capsys.readouterr().out
    why = [line for line in out.splitlines() if line.startswith("Does not fit:")]
    assert len(why) == 1 and "no checkpointing" in why[0] and "micro-batches" in why[0]
    assert f"MFU {e.mfu:.1%}" in out


def test_405b_meta_layout_as_ndparallel_would_run_it(meta_run):
    """With no setting flag, Meta's layout fits at >= 36.6 % MFU (43 % less 15 %): the search
    chooses what Meta's settings need in ndparallel's runtime — selective checkpointing, offloaded,
    no resharding after forward, gradients reduced once per step, the deepest interleave."""
    _, runnable, _ = meta_run
    e = runnable.best
    assert e.fits and e.mfu >= 0.366, (e.settings, e.mfu)
    s = e.settings
    assert (s.recompute, s.activation_offloading, s.reshard_after_forward) == ("selective", True, False)
    assert s.unsharded_grad_accumulation and s.pipeline_virtual_stages == 7
    first, last = (e.pipeline.ranks[k][1].total for k in ("first", "last"))
    assert first > last and e.pipeline.worst == "first" and e.memory.total == first
    assert e.pipeline.stretch > 1.5  # 126 layers in 112 stages: the first stages hold 2 layers, the rest 1


def test_405b_planner_best_is_at_least_metas_row(meta_run):
    """The planner's best for the same request is at least that row, its settings written into
    the config it writes."""
    _, runnable, result = meta_run
    best = result.ranked[0].best
    assert best.fits and best.mfu >= runnable.best.mfu
    fsdp = train_config(best, result)["fsdp_config"]
    assert fsdp["unsharded_grad_accumulation"] is best.settings.unsharded_grad_accumulation
    assert fsdp["reshard_after_forward"] is best.settings.reshard_after_forward


SELECTIVE_OFFLOAD = dict(
    micro_batch_size=1,
    activation_checkpointing=True,
    pipeline_schedule="Interleaved1F1B",
    pipeline_virtual_stages=7,
    unsharded_grad_accumulation=True,
)
"""Meta's layout as ndparallel runs it with selective checkpointing (v = 7, gradients reduced once
per step), with and without activation offloading (issue 50)."""


@pytest.fixture(scope="module")
def selective_run():
    req = _req(
        "llama-3.1-405b",
        8192,
        sequence_len=8192,
        global_batch_size=2048,
        reshard_after_forward=False,
        ac_policy="selective",
    )
    kept, off = (
        evaluate_layout(req.updated(activation_offloading=o), META, **SELECTIVE_OFFLOAD)
        for o in (False, True)
    )
    return req.updated(activation_offloading=True), kept.options[0], off


def test_405b_meta_layout_fits_with_selective_offloading(selective_run):
    """Selective checkpointing keeps ~55 KB per token and layer at tp 8: 18 micro-batches in flight
    through the first rank's 8 layers do not fit 80 GB. Offloaded, that rank keeps each layer's
    down_proj output and each stage's received input: it fits, at the same step time (the copies
    hide behind the compute at 50 GB/s), within 15 % of Meta's 43 %."""
    _, kept, off = selective_run
    e = off.best
    assert not kept.fits and off.ok and e.fits and e.settings.activation_offloading
    assert e.mfu >= 0.366 and abs(e.mfu / META_MFU - 1) <= 0.15, e.mfu
    assert e.time.offload_exposed == 0.0 and e.time.step == pytest.approx(kept.time.step)
    # the first rank's device activations: per micro-batch in flight, every layer's saved set less
    # its residue (e·h/t) and the stages' inputs (7 stages, the first's are token ids) kept; one
    # layer's saved set back on the device for its backward, but its attention half (not back
    # in its MLP's backward, where the peak is)
    shape = rank_shape(L405, 16, 7, "Interleaved1F1B", 0)
    (k_mem, o_mem) = (x.pipeline.ranks["first"][1] for x in (kept, e))
    assert k_mem.peak_phase == o_mem.peak_phase == "layer backward"
    held = in_flight("Interleaved1F1B", 16, 32, 7, 0)
    tokens, residue = 8192, 2 * L405.hidden / 8
    saved = selective_saved_per_token(rank_model(L405, shape), META, e.settings)
    moved = held * (shape.layers * tokens * (saved - residue) - (7 - 1) * tokens * residue)
    later = offloaded_attention_half_per_token(rank_model(L405, shape), META, e.settings)
    assert 0 < later < saved - residue
    assert k_mem.activations - o_mem.activations == pytest.approx(moved - tokens * (saved - residue - later))
    # host: every micro-batch in flight through the first rank's layers, less the residue, and
    # RoPE's cos and sin once per stage's forward
    rope = 7 * tokens * 2 * 2 * L405.head_dim
    assert e.memory.host_offload == pytest.approx(held * (shape.layers * tokens * (saved - residue) + rope))


def test_405b_search_beats_metas_row(selective_run):
    """The search (its schedules: 1F1B, Interleaved1F1B at 2 stages per rank and as deep as every
    stage keeps a layer) finds for that cluster at least Meta's layout as ndparallel runs it
    (selective + offloading); it needs the deep interleave: at 2 stages per rank its best is below."""
    req, _, off = selective_run
    roomy = req.updated(host_mem_bytes=2e12)
    best = plan(roomy).ranked[0].best
    assert best.fits and best.layout.pp > 1 and best.mfu >= off.best.mfu, (best.layout, best.mfu)
    assert best.settings.pipeline_virtual_stages > 2
    shallow = plan(roomy.updated(pipeline_schedule="Interleaved1F1B", pipeline_virtual_stages=2))
    assert shallow.ranked[0].best.mfu < off.best.mfu


def test_405b_selective_offloading_host_check(selective_run, capsys):
    """The node's host memory bounds it: its 8 GPUs' offloaded bytes against 80 % of --host-mem;
    --explain then names the host, not the device (which it fits)."""
    req, _, off = selective_run
    per_node = 8 * off.best.memory.host_offload
    roomy = evaluate_layout(req.updated(host_mem_bytes=per_node / 0.8 * 1.01), META, **SELECTIVE_OFFLOAD)
    short_req = req.updated(host_mem_bytes=per_node / 0.8 * 0.99)
    short = evaluate_layout(short_req, META, **SELECTIVE_OFFLOAD)
    assert roomy.ok and not short.ok and [code for code, _ in short.rejections] == ["host_oom"]
    print_explain(short, PlanResult(short_req, [], [short]), Console(width=200))
    out = capsys.readouterr().out
    assert "[host_oom]" in out and "Does not fit:" not in out


def test_explain_prints_the_host_memory_per_node(capsys):
    args = [
        "--base-model",
        "llama-3.1-405b",
        "--gpus",
        "8192",
        "--gpu",
        "h100-80gb",
        "--sequence-len",
        "8192",
        "--global-batch-size",
        "2048",
        "--no-reshard-after-forward",
        "--ac-policy",
        "selective",
        "--activation-offloading",
        "--explain",
        "pp=16,ds=64,tp=8,mb=1,ac=on,uga=on,schedule=Interleaved1F1B,v=7",
    ]
    assert main(args) == 0
    out = capsys.readouterr().out
    host = [
        line for line in out.splitlines() if "host (pinned) memory" in line or "per node (8 GPUs)" in line
    ]
    assert len(host) == 2 and "MFU" in out and "Does not fit" not in out
