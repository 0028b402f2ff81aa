"""Planner search and CLI: rejection reasons, agreement with ParallelismConfig, outputs."""

import json
from dataclasses import replace

import pytest
import yaml

from ndparallel.layout.config import ParallelismConfig
from ndparallel.layout.dims import ParallelDims
from ndparallel.plan.cli.explain_keys import parse_layout
from ndparallel.plan.cli.main import main, run_plan
from ndparallel.plan.cli.parser import parse
from ndparallel.plan.hardware import PRESETS as HW
from ndparallel.plan.models import PRESETS
from ndparallel.plan.search.evaluation import evaluate_layout, plan
from ndparallel.plan.search.layouts import enumerate_layouts
from ndparallel.plan.search.request import PlanRequest
from ndparallel.plan.settings import Settings
from ndparallel.runtime.sizes import parse_size

H100 = HW["h100-80gb"]


def _req(model="llama-3.1-8b", gpus=8, **kw):
    kw.setdefault("gpus_per_node", min(8, gpus))
    return PlanRequest.of(PRESETS[model], kw.pop("hardware", H100), gpus, **kw)


def _codes(req, layout):
    return [c for c, _ in evaluate_layout(req, layout).rejections]


def test_rejection_reasons():
    assert _codes(_req(gpus=16, gpus_per_node=8), ParallelDims(1, 1, 1, 16)) == ["tp_beyond_node", "kv_heads"]
    assert "world_size" in _codes(_req(gpus=8), ParallelDims(1, 2, 1, 1))
    r3b = _req("llama-3.2-3b", gpus=16, gpus_per_node=16)
    assert {"heads", "kv_heads"} <= set(_codes(r3b, ParallelDims(1, 1, 1, 16)))  # 24 and 8 heads
    r6 = _req("llama-3.2-3b", gpus=6, gpus_per_node=6)
    assert {"kv_heads", "ffn"} <= set(_codes(r6, ParallelDims(1, 2, 1, 3)))  # 8 kv, 8192 ffn vs 3
    seq = _req(gpus=8, sequence_len=4100)
    assert _codes(seq, ParallelDims(1, 2, 4, 1)) == ["seq_cp"]  # 4100 % 8 != 0
    assert _codes(_req(gpus=8, sequence_len=4098), ParallelDims(1, 2, 1, 4)) == ["seq_tp"]
    assert _codes(_req("llama-3.1-405b", gpus=8), ParallelDims(1, 8, 1, 1)) == ["oom"]
    gb = _req(gpus=8, global_batch_size=6, micro_batch_size=1)
    assert _codes(gb, ParallelDims(1, 4, 1, 2)) == ["global_batch"]
    msg = evaluate_layout(_req("llama-3.1-405b", gpus=8), ParallelDims(1, 8, 1, 1)).rejections[0][1]
    assert "out of memory" in msg and "GiB" in msg


@pytest.mark.parametrize("world", [1, 2, 3, 4, 6, 8, 12, 16, 24, 64])
def test_enumerator_agrees_with_parallelism_config(world):
    layouts = enumerate_layouts(world)
    assert len(set(layouts)) == len(layouts)
    assert all(lay.world == world for lay in layouts)
    result = plan(_req("llama-3.2-1b", gpus=world, sequence_len=2048, gpus_per_node=min(8, world)))
    proposed = [r.layout for r in result.ranked]
    assert proposed, "some layout must fit a 1B model"
    for lay in proposed:
        pc = ParallelismConfig(
            dp_replicate_size=lay.dp_replicate,
            dp_shard_size=lay.dp_shard,
            cp_size=lay.cp,
            tp_size=lay.tp,
            pp_size=lay.pp,
        ).resolve(world)
        assert pc.total_size == world
    # every rejection has a reason
    assert all(r.rejections for r in result.rejected)


def test_ranked_fit_and_are_sorted():
    result = plan(_req("llama-3.1-70b", gpus=64, sequence_len=8192))
    tps = [r.best.tokens_per_s_per_gpu for r in result.ranked]
    assert tps == sorted(tps, reverse=True)
    assert all(r.best.memory.total <= H100.mem_bytes for r in result.ranked)
    assert all(0 < r.best.mfu < H100.matmul_efficiency for r in result.ranked)
    assert not any(r.layout.tp > 8 for r in result.ranked)


def test_settings_checkpointing_choice():
    res = evaluate_layout(_req(gpus=8, activation_checkpointing="off"), ParallelDims(1, 8, 1, 1))
    assert all(not o.settings.activation_checkpointing for o in res.options)
    res = evaluate_layout(
        _req(gpus=8), ParallelDims(1, 8, 1, 1), micro_batch_size=2, activation_checkpointing=True
    )
    assert {(o.settings.micro_batch_size, o.settings.activation_checkpointing) for o in res.options} == {
        (2, True)
    }
    # the settings checkpointing leaves open are searched: the policy, offloading, resharding
    searched = {
        (o.settings.ac_policy, o.settings.activation_offloading, o.settings.reshard_after_forward)
        for o in res.options
    }
    assert searched == {
        (p, o, r) for p in ("selective", "full") for o in (False, True) for r in (False, True)
    }
    # each pinned, one option
    pins = dict(
        ac_policy="selective", activation_offloading=True, reshard_after_forward=False, tiled_mlp=False
    )
    (only,) = evaluate_layout(
        _req(gpus=8), ParallelDims(1, 8, 1, 1), micro_batch_size=2, activation_checkpointing=True, **pins
    ).options
    assert all(getattr(only.settings, k) == v for k, v in pins.items())


def test_parse_layout_forms(capsys):
    """``--explain``'s keys are the training config's (its aliases too); the compact form; the
    older short keys are read with one note each."""
    lay = ParallelDims(2, 4, 1, 8)
    assert parse_layout(
        "dp_replicate_size=2,dp_shard_size=4,context_parallel_size=1,tensor_parallel_size=8"
    ) == (
        lay,
        {},
    )
    assert parse_layout("2x4x1x8") == (lay, {})
    assert parse_layout("dp_replicate_size=2 dp_shard_size=4 tp_size=8") == (lay, {})
    pins = {"micro_batch_size": 2, "activation_checkpointing": True}
    assert parse_layout(
        "dp_shard_size=4,tp_size=8,dp_replicate_size=2,micro_batch_size=2,activation_checkpointing=on"
    ) == (
        lay,
        pins,
    )
    assert parse_layout("pipeline_parallel_size=2,dp_shard_size=4") == (ParallelDims(dp_shard=4, pp=2), {})
    assert parse_layout(
        "pp16:1x64x1x8,micro_batch_size=1,pipeline_schedule=interleaved1f1b,pipeline_virtual_stages=4"
    ) == (
        ParallelDims(1, 64, 1, 8, pp=16),
        {"micro_batch_size": 1, "pipeline_schedule": "Interleaved1F1B", "pipeline_virtual_stages": 4},
    )
    assert capsys.readouterr().err == ""
    assert parse_layout("ds=4,tp=8,dr=2,mb=2,ac=on") == (lay, pins)  # today's short keys, for one release
    notes = capsys.readouterr().err.splitlines()
    assert len(notes) == 5 and "--explain key 'mb' is deprecated: use micro_batch_size=" in notes[3]
    with pytest.raises(ValueError, match="dp_shard_size"):
        parse_layout("zz=2")


def test_layout_text_reads_back():
    """The ``--explain`` text a table prints names the layout and its pins as ``parse_layout``
    reads them."""
    from ndparallel.plan.cli.explain_keys import layout_text

    for lay in (ParallelDims(2, 4, 1, 8), ParallelDims(1, 64, 1, 8, pp=16), ParallelDims(1, 8, 1, 2, ep=8)):
        text = layout_text(lay, pipeline_schedule="1F1B", unsharded_grad_accumulation="on")
        assert parse_layout(text) == (lay, {"pipeline_schedule": "1F1B", "unsharded_grad_accumulation": True})


def test_parse_size():
    assert parse_size("80GB", gb_is_gib=True) == 80 * 2**30
    assert parse_size("1.5TB") == 1.5e12
    with pytest.raises(ValueError):
        parse_size("lots")


ISSUE_CMD = [
    "--base-model",
    "llama-3.1-70b",
    "--gpus",
    "64",
    "--gpus-per-node",
    "8",
    "--gpu",
    "h100-80gb",
    "--sequence-len",
    "8192",
]


def test_issue_command_table(capsys):
    assert main(ISSUE_CMD) == 0
    out = capsys.readouterr().out
    assert "Ranked layouts" in out and "tok/s/GPU" in out and "Rejected" in out


def test_json_output(capsys):
    assert main(ISSUE_CMD + ["--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["model"]["name"] == "llama-3.1-70b"
    assert data["ranked"] and all(r["ok"] for r in data["ranked"])
    assert {r["rejections"][0]["code"] for r in data["rejected"]} >= {"oom", "tp_beyond_node"}


def test_explain(capsys):
    assert main(ISSUE_CMD + ["--explain", "dp_replicate=2,dp_shard=4,cp=1,tp=8"]) == 0
    out = capsys.readouterr().out
    assert "Memory per GPU" in out and "Collectives per rank per step" in out
    assert main(ISSUE_CMD + ["--explain", "1x1x1x64"]) == 0
    assert "tp_beyond_node" in capsys.readouterr().out
    assert main(ISSUE_CMD + ["--explain", "2x4x1x8,mb=1,ac=on", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["ok"] and data["collectives"]
    assert {c["mesh_dim"] for c in data["collectives"]} >= {"tp", "dp_shard_cp", "dp_replicate"}


def test_write_config(tmp_path, capsys):
    out = tmp_path / "train.yaml"
    assert main(ISSUE_CMD + ["--write-config", str(out)]) == 0
    cfg = yaml.safe_load(out.read_text())
    keys = {
        "base_model",
        "dp_replicate_size",
        "dp_shard_size",
        "tensor_parallel_size",
        "context_parallel_size",
        "sequence_len",
        "micro_batch_size",
        "gradient_accumulation_steps",
        "fsdp_config",
        "bf16",
    }
    assert keys <= set(cfg)
    assert cfg["base_model"] == "meta-llama/Llama-3.1-70B" and cfg["sequence_len"] == 8192
    assert isinstance(cfg["fsdp_config"]["activation_checkpointing"], bool)
    from ndparallel.config import TrainConfig  # the emitted file is a valid train config

    TrainConfig.model_validate(cfg)
    world = (
        cfg["dp_replicate_size"]
        * cfg["dp_shard_size"]
        * cfg["tensor_parallel_size"]
        * cfg["context_parallel_size"]
        * cfg.get("pipeline_parallel_size", 1)
    )
    assert world == 64


def test_run_plan_with_own_parser_and_overrides(tmp_path, capsys):
    hw_file = tmp_path / "hw.json"
    hw_file.write_text(json.dumps({"hardware": HW["a100-40gb"].to_dict()}))
    args = parse(
        [
            "--base-model",
            "llama-3.2-1b",
            "--gpus",
            "4",
            "--hardware-file",
            str(hw_file),
            "--gpu-mem",
            "24GB",
            "--global-batch-tokens",
            "65536",
            "--sequence-len",
            "2048",
            "--micro-batch-size",
            "1",
            "--json",
        ]
    )
    assert run_plan(args) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["hardware"]["mem_bytes"] == 24 * 2**30
    assert data["hardware"]["name"] == "a100-40gb+custom"
    for r in data["ranked"]:
        b = r["best"]
        assert b["global_batch_sequences"] == 32
        assert b["settings"]["micro_batch_size"] == 1


def test_bad_input_exit_code(capsys):
    assert main(["--base-model", "nope", "--gpus", "8"]) == 2
    assert "unknown model" in capsys.readouterr().err


def test_settings_but_is_replace_and_cached_hashes_match_equality():
    """The search's cheap copies and cached hashes (``Settings.but``, ``ModelSpec`` / ``Hardware``
    ``__hash__``) are the dataclass semantics they stand in for."""
    s = Settings(sequence_len=4096, micro_batch_size=2, lora_saved=("embed",))
    changed = s.but(
        gradient_accumulation_steps=8, activation_checkpointing=True, pipeline_schedule="Interleaved1F1B"
    )
    assert changed == replace(
        s, gradient_accumulation_steps=8, activation_checkpointing=True, pipeline_schedule="Interleaved1F1B"
    )
    assert hash(changed) == hash(replace(changed)) and s.gradient_accumulation_steps == 1
    with pytest.raises(TypeError, match="no_such_field"):
        s.but(no_such_field=1)
    model, hw = PRESETS["llama-3.1-8b"], HW["h100-80gb"]
    for obj in (model, hw):
        assert hash(obj) == hash(replace(obj)) and obj == replace(obj)
    assert hash(replace(model, layers=3)) != hash(model)


def test_offloading_pinned_on_pins_checkpointing_unless_that_is_pinned_off():
    from ndparallel.plan.search.choices import checkpointing

    req = _req(gpus=8)
    assert {ac for ac, _, o in checkpointing(req, None, None, True)} == {True}
    assert checkpointing(req, False, None, True) == [(False, "full", False)]
    assert len(checkpointing(req, None, None, None)) == 5  # off; selective, full × offloaded or not
