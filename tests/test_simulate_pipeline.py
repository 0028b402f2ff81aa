"""``ndparallel simulate`` of a pipeline-parallel world: the first stage's rank of PP 2 × FSDP 2 runs
its stage directly (torch's schedules cannot start over fake collectives) in the schedule's order,
so the activations in flight are the schedule's: GPipe keeps every micro-batch, 1F1B p − s; the
planner's model of a pp rank's stage against the simulated first and last stage."""

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from cli_helpers import run_cli_fd
from ndparallel.parallel.pp.split import StagePlan

ROOT = Path(__file__).resolve().parents[1]
MODEL = dict(
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=2048,
    max_position_embeddings=1024,
    tie_word_embeddings=False,
)


def _in_flight(actions, stage):
    held = peak = 0
    for kind, s, _ in actions:
        if s == stage and kind in "FBI":
            held += 1 if kind == "F" else -1
            peak = max(peak, held)
    return peak


def test_single_stage_orders_keep_the_schedules_micro_batches_in_flight():
    from ndparallel.tools.simulate_pipeline import rank_actions

    for schedule, want in (("GPipe", lambda s: 8), ("1F1B", lambda s: 4 - s)):
        plan = StagePlan(4, 1, schedule, ((0,), (1,), (2,), (3,)))
        for rank in range(4):
            actions = rank_actions(SimpleNamespace(plan=plan), rank, 8)
            assert sorted(a for a in actions if a[0] == "F") == [("F", rank, i) for i in range(8)]
            assert sorted(a for a in actions if a[0] == "B") == [("B", rank, i) for i in range(8)]
            assert _in_flight(actions, rank) == want(rank), (schedule, rank, actions)


def _first_stage_peaks():
    """In a forked child: rank 0 of a fake PP 2 × FSDP 2 world, each schedule's step measured."""
    import torch
    from transformers import LlamaConfig

    from ndparallel import ParallelismConfig
    from ndparallel.engine import Engine, forward_backward
    from ndparallel.parallel.options import FSDPOptions, PipelineOptions, StrategyOptions
    from ndparallel.runtime.distributed import shutdown
    from ndparallel.runtime.fake_world import start_fake_world
    from ndparallel.runtime.memory_probe import LiveBytes
    from ndparallel.tools.simulate_pipeline import DirectSchedule, build_random_stages

    shutdown()  # the runner's one-rank gloo group: this child is rank 0 of a fake world of 4 instead
    start_fake_world(4, 0)
    torch.manual_seed(0)
    mbs = [
        {
            "input_ids": torch.randint(0, 2048, (1, 32)),
            "shift_labels": torch.randint(0, 2048, (1, 32)),
            "position_ids": torch.arange(32)[None],
        }
        for _ in range(8)
    ]
    out = {}
    try:
        for schedule in ("GPipe", "1F1B", "Interleaved1F1B", "ZBVZeroBubble"):
            engine = Engine(
                ParallelismConfig(pp_size=2, dp_shard_size=2),
                StrategyOptions(  # gradients reduced every micro-batch: only activations grow with m
                    fsdp=FSDPOptions(unsharded_grad_accumulation=False),
                    pipeline=PipelineOptions(schedule=schedule),
                ),
                device="cpu",
            )
            model = build_random_stages(engine, LlamaConfig(**MODEL), torch.float32, "sdpa", False)
            direct = DirectSchedule(engine, engine.pipeline_of(model))
            direct.install()
            forward_backward(engine, model, mbs)  # gradients exist before the measured steps
            peaks = {}
            for m in (4, 8):
                with LiveBytes() as live:
                    forward_backward(engine, model, mbs[:m])
                peaks[m] = live.peak
            out[schedule] = {
                "peak": peaks,
                "stages": sorted(direct.pipeline.modules),
                "actions": direct.actions(8),
                "grads": all(p.grad is not None for p in model.parameters()),
            }
    finally:
        shutdown()
    return out


def test_first_stage_rank_runs_every_schedule_with_its_in_flight_memory():
    from ndparallel.testing import run_on_ranks

    got = run_on_ranks(_first_stage_peaks, 1)[0]
    assert got["ZBVZeroBubble"]["stages"] == [0, 3] and got["Interleaved1F1B"]["stages"] == [0, 2]
    for schedule, r in got.items():
        assert r["grads"], schedule
        for stage in r["stages"]:  # every micro-batch forward once and backward once on each stage
            forwards = [a for a in r["actions"] if a[:2] == ("F", stage)]
            backs = [a for a in r["actions"] if a[1] == stage and a[0] in "BI"]
            assert len(forwards) == len(backs) == 8, (schedule, stage, r["actions"])
    # stage 0 keeps m micro-batches' activations under GPipe, 2 (= p) under 1F1B, whatever m
    gpipe, one_f_one_b = got["GPipe"]["peak"], got["1F1B"]["peak"]
    per_mb = (gpipe[8] - gpipe[4]) / 4
    assert per_mb > 0, got
    assert 5 * per_mb <= gpipe[8] - one_f_one_b[8] <= 7 * per_mb, (per_mb, gpipe, one_f_one_b)
    assert abs(one_f_one_b[8] - one_f_one_b[4]) <= per_mb / 2, (per_mb, one_f_one_b)


@pytest.fixture(scope="module")
def config(tmp_path_factory):
    from transformers import LlamaConfig

    tmp = tmp_path_factory.mktemp("simulate_pp")
    LlamaConfig(**MODEL).save_pretrained(tmp / "model")
    path = tmp / "cfg.yaml"
    path.write_text(
        f"base_model: {tmp / 'model'}\ntokenizer: builtin:stdlib\n"
        "datasets:\n  - {path: builtin:stdlib, max_files: 20}\n"
        "sequence_len: 64\nmicro_batch_size: 1\ngradient_accumulation_steps: 4\n"
        f"pipeline_parallel_size: 2\noutput_dir: {tmp / 'run'}\n"
    )
    return path


@pytest.mark.parametrize("rank,unsharded", [(0, False), (7, True)])
def test_simulate_cli_against_the_planner_on_a_pp_world(config, rank, unsharded, capfd):
    """The first stage's rank (0), reducing every micro-batch (the fallback), and, accumulating
    gradients unsharded (the default under PP), the last stage's (7) of
    PP 2 + FSDP 4: the planner's model of this rank's stage within 10 % of the measured tensor
    peak, its collectives per mesh dim (FSDP, the step's scalars, the loss and norm across stages)
    those the rank issued — but, reducing every micro-batch, one all-gather per step on the first
    stage (its last layer, re-gathered by FSDP's prefetch under 1F1B: docs/planner.md)."""
    sets = ["--set", "dp_shard_size=-1"] + (  # unsharded accumulation is the default under PP
        [] if unsharded else ["--set", "fsdp_config.unsharded_grad_accumulation=false"]
    )
    code, out, err = run_cli_fd(
        capfd, "simulate", config, "--world-size", "8", *sets, "--rank", rank, "--steps", "1", "--json"
    )  # from this process; the simulated rank runs in a fresh child, as always
    assert code == 0, err[-3000:]
    report = json.loads(out)
    assert report["layout"]["describe"] == "PP 2 + FSDP 4" and report["layout"]["rank"] == rank
    pl, predicted = report["measured"]["pipeline"], report["predicted"]
    assert (
        pl["stages"] == [rank // 4] and pl["first_stage"] == (rank == 0) and pl["last_stage"] == (rank == 7)
    )
    assert pl["bubble"] == pytest.approx(1 / 5) and pl["microbatches"] == 4
    assert predicted["pipeline"] == {
        "pp_rank": rank // 4,
        "stage": "first" if rank == 0 else "last",
        "layers": 2,
        "in_flight": 2.0 if rank == 0 else 1.0,
    }
    assert abs(predicted["error"]["tensor_peak"]) <= 0.10, predicted
    got, want = report["collectives"], report["predicted_collectives"]
    assert set(got) == set(want) == {"dp", "dp_cp", "dp_shard_cp", "pp", "world"}, (got, want)
    for dim in got:
        extra = got[dim]["calls"] - want[dim]["calls"]
        assert extra == (1 if dim == "dp_shard_cp" and rank == 0 and not unsharded else 0), (dim, got, want)
        assert (got[dim]["bytes"] == want[dim]["bytes"]) == (extra == 0), (dim, got, want)
    assert "loss" not in json.dumps(report["measured"])


def _expert_mesh_in_fake_world():
    """In a forked child: rank 0 of a fake world of 4, the mesh and expert mesh built with a
    timeout as the engine builds them (``simulate`` of an EP layout)."""
    import datetime

    from ndparallel.layout.dims import ParallelDims
    from ndparallel.layout.mesh import build_expert_mesh, build_mesh
    from ndparallel.runtime.distributed import shutdown
    from ndparallel.runtime.fake_world import start_fake_world

    shutdown()
    start_fake_world(4, 0)
    timeout = datetime.timedelta(seconds=60)
    try:
        mesh = build_mesh("cpu", {"dp_replicate": 1, "dp_shard": 4, "cp": 1, "tp": 1}, timeout)
        experts = build_expert_mesh(mesh, ParallelDims(dp_shard=4, ep=2), timeout)
        return experts.mesh_dim_names, tuple(experts.shape)
    finally:
        shutdown()


def test_expert_mesh_builds_in_a_fake_world():
    """A fake group takes no backend options: the expert mesh's groups (``efsdp``, ``ep``) were
    created with gloo's timeout options, and ``simulate`` of every EP layout failed at setup."""
    from ndparallel.testing import run_on_ranks

    names, shape = run_on_ranks(_expert_mesh_in_fake_world, 1)[0]
    assert names == ("dp_replicate", "efsdp", "ep") and shape == (1, 2, 2)
