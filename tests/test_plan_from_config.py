"""``ndparallel plan --config TRAIN.yaml``: the training config's settings become the planner's
defaults (flags on the command line win), the global batch is the config's, and --write-config
writes the config back with only the layout and batch replaced — a run with the same batch."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from cli_helpers import run_cli

ROOT = Path(__file__).resolve().parents[1]
LORA_8B = ROOT / "examples/gpu/llama-3.1-8b-lora-fsdp-tp.yaml"  # FSDP 4 × TP 2, micro 1 × accum 4


def test_config_settings_become_the_request(capsys):
    code, out, err = run_cli(capsys, "plan", "--config", LORA_8B, "--gpus", "8", "--json")
    assert code == 0, err
    req = json.loads(out)["request"]
    assert (req["sequence_len"], req["global_batch_size"], req["lora_r"]) == (16384, 16, 16)  # 1 × 4 × dp 4
    assert (req["mixed_precision"], req["activation_checkpointing"], req["sequence_parallel"]) == (
        "bf16",
        "on",
        True,
    )
    assert json.loads(out)["model"]["name"] == "llama-3.1-8b"  # base_model's Hub id -> the preset
    assert "global batch 16 sequences (micro 1 × accumulation 4 × dp 4)" in err


def test_flags_on_the_command_line_win(capsys):
    code, out, err = run_cli(
        capsys,
        "plan",
        "--config",
        LORA_8B,
        "--gpus",
        "8",
        "--json",
        "--sequence-len",
        "4096",
        "--global-batch-size",
        "64",
        "--adapter",
        "none",
    )
    assert code == 0, err
    req = json.loads(out)["request"]
    assert (req["sequence_len"], req["global_batch_size"], req["lora_r"]) == (4096, 64, 0)


def test_write_config_keeps_the_run_and_its_batch(capsys, tmp_path):
    out = tmp_path / "planned.yaml"
    code, _, err = run_cli(
        capsys, "plan", "--config", LORA_8B, "--gpus", "16", "--top", "1", "--write-config", out
    )
    assert code == 0, err
    assert "dp 4 of its own 8-rank layout" in err  # the config is for 8 ranks: its batch is kept
    source, planned = yaml.safe_load(LORA_8B.read_text()), yaml.safe_load(out.read_text())
    layout = [
        planned.get(k, 1)
        for k in ("dp_replicate_size", "dp_shard_size", "context_parallel_size", "tensor_parallel_size")
    ]
    assert layout[0] * layout[1] * layout[2] * layout[3] == 16
    dp = layout[0] * layout[1]
    assert planned["micro_batch_size"] * planned["gradient_accumulation_steps"] * dp == 16  # same batch
    for key in ("datasets", "learning_rate", "lora_r", "output_dir", "max_steps", "base_model"):
        assert planned[key] == source[key], key
    from ndparallel.axolotl import load_config

    load_config(str(out))  # a valid training config


def test_bad_config_is_one_line(capsys, tmp_path):
    code, _, err = run_cli(capsys, "plan", "--config", tmp_path / "nope.yaml", "--gpus", "8")
    assert code == 2 and "config file" in err and "not found" in err
    auto = tmp_path / "auto.yaml"
    auto.write_text("base_model: llama-3.1-8b\ndp_shard_size: -1\ntensor_parallel_size: 3\n")
    code, _, err = run_cli(capsys, "plan", "--config", auto, "--gpus", "8")
    assert code == 2 and "--global-batch-size" in err, err
    assert len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize(
    "fields, key, value",
    [
        ("qat: {weight_dtype: int4, activation_dtype: int8, group_size: 32}\n", "qat", "int4/int8"),
        (
            "adapter: lora\nlora_r: 16\nlora_modules_to_save: [embed_tokens, lm_head]\n",
            "lora_saved",
            ["embed", "head"],
        ),
    ],
    ids=["qat", "lora_modules_to_save"],
)
def test_a_configs_field_reaches_the_planner(capsys, tmp_path, fields, key, value):
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(
        "base_model: meta-llama/Llama-3.1-8B\nsequence_len: 2048\nmicro_batch_size: 1\n"
        "datasets: [{path: 'builtin:stdlib'}]\n" + fields
    )
    code, out, err = run_cli(capsys, "plan", "--config", cfg, "--gpus", "8", "--json")
    assert code == 0, err
    assert json.loads(out)["request"][key] == value


@pytest.mark.parametrize(
    "fields",
    [
        "fsdp_config: {activation_checkpointing: true, reshard_after_forward: false}\n"
        "tiled_mlp: true\ntiled_mlp_num_shards: 4\nactivation_offloading: true\nbf16: true\n",
        "tensor_parallel_size: 2\nsequence_parallel: true\nloss_parallel: false\nchunked_loss: true\n"
        "loss_chunk_tokens: 2048\ncp_comm_strategy: alltoall\noptimizer: adamw_torch_fused\n",
        "qat: {weight_dtype: int4, activation_dtype: int8, group_size: 32}\noptimizer: sgd\n",
    ],
    ids=["memory", "tp-loss", "qat"],
)
def test_the_request_carries_the_configs_runtime_options(capsys, tmp_path, fields):
    """TrainConfig -> runtime options -> ``plan_settings`` is what the planner is asked: every
    setting a flag carries arrives as the config's options say."""
    from ndparallel.axolotl import load_config
    from ndparallel.config.plan_settings import plan_settings
    from ndparallel.plan.cli.from_flags import SETTINGS

    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(
        "base_model: meta-llama/Llama-3.1-8B\nsequence_len: 2048\nmicro_batch_size: 1\n"
        "datasets: [{path: 'builtin:stdlib'}]\n" + fields
    )
    code, out, err = run_cli(capsys, "plan", "--config", cfg, "--gpus", "8", "--json")
    assert code == 0, err
    req = json.loads(out)["request"]
    settings = plan_settings(load_config(str(cfg)))
    names = sorted(SETTINGS | {"optimizer", "optimizer_fused"})
    assert len(names) > 10
    got = {n: tuple(req[n]) if isinstance(req[n], list) else req[n] for n in names}
    assert got == {n: getattr(settings, n) for n in names}
    assert req["activation_checkpointing"] == ("on" if settings.activation_checkpointing else "auto")


def test_the_405b_example_is_metas_layout_and_fits(capsys):
    """examples/gpu/llama-3.1-405b-meta-layout.yaml: its own layout, read from the config (the
    schedule, depth, selective checkpointing and offloading included), fits 80 GB at >= 36.6 % MFU
    (within 15 % of Meta's 43 %; issue 50) with 2 TB of host memory per node."""
    example = ROOT / "examples/gpu/llama-3.1-405b-meta-layout.yaml"
    argv = ["plan", "--config", example, "--gpus", "8192", "--gpus-per-node", "8", "--gpu", "h100-80gb"]
    code, out, err = run_cli(capsys, *argv, "--host-mem", "2TB", "--explain", "pp16:1x64x1x8", "--json")
    assert code == 0, err
    best = json.loads(out)["best"]
    s = best["settings"]
    assert (
        s["pipeline_schedule"],
        s["pipeline_virtual_stages"],
        s["ac_policy"],
        s["activation_offloading"],
    ) == (
        "Interleaved1F1B",
        7,
        "selective",
        True,
    )
    assert best["fits"] and best["mfu"] >= 0.366, (best["mfu"], best["memory_gib"])
    assert "global batch 2048 sequences (micro 1 × accumulation 32 × dp 64)" in err
    # the check before launch counts the same host bytes (preflight/host_memory.py)
    from ndparallel.axolotl import load_config
    from ndparallel.preflight.checks import run_checks
    from ndparallel.preflight.host_memory import offloaded

    cfg = load_config(str(example))
    found = run_checks(cfg, 8192, check_local=False)
    host = offloaded(cfg, found.pc, found.hf).host_bytes
    assert host == pytest.approx(best["memory_gib"]["host_offload"] * 2**30, rel=1e-9)


def test_the_405b_examples_dry_run_counts_the_first_ranks_offloaded_layers(capsys, monkeypatch):
    """Its dry run states the host memory of the first pipeline rank's 8 layers (of 126) at its
    peak, 18.1 micro-batches in flight: the planner's 57.8 GiB per GPU
    (``test_the_405b_example_is_metas_layout_and_fits``)."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    example = ROOT / "examples/gpu/llama-3.1-405b-meta-layout.yaml"
    code, out, err = run_cli(capsys, "train", example, "--dry-run")
    assert code == 0, err
    line = next(x for x in out.splitlines() if x.startswith("long context"))
    assert "activation offloading (8 layers' selective saved tensors" in line, line
    # the figure docs/planner_derivation.md states (57.8 GiB per GPU), the bytes the test above
    # finds equal to plan --explain's
    host = re.search(r"([\d.]+) GiB of pinned host memory on the first pipeline rank at its peak", line)
    assert host and abs(float(host.group(1)) - 57.8) < 0.05, line
    assert "18.1 micro-batch(es) in flight" in line, line


@pytest.mark.parametrize("named", [True, False], ids=["named", "default"])
def test_max_seq_len_keeps_the_configs_cp_strategy_when_it_names_one(capsys, tmp_path, named):
    """``cp_comm_strategy`` written in the config pins ``--max-seq-len`` to it, as the flag would;
    a config that leaves it out lets the search try every strategy (it then finds others here)."""
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(
        "base_model: meta-llama/Llama-3.1-8B\nsequence_len: 2048\nmicro_batch_size: 1\n"
        "datasets: [{path: 'builtin:stdlib'}]\ntiled_mlp: true\nactivation_offloading: true\n"
        "fsdp_config: {activation_checkpointing: true}\n" + ("cp_comm_strategy: allgather\n" if named else "")
    )
    code, out, err = run_cli(capsys, "plan", "--config", cfg, "--gpus", "8", "--max-seq-len", "--json")
    assert code == 0, err
    used = {
        r["at_max"]["settings"]["cp_comm_strategy"] for r in json.loads(out)["longest"] if r.get("at_max")
    }
    assert (used == {"allgather"}) if named else (len(used) > 1), used


PARITY = ROOT / "tests/fixtures/axolotl/parity"  # a tiny Llama, its tokenizer and Axolotl's data files


def _alpaca_config(tmp_path, **fields) -> Path:
    cfg = {
        "base_model": str(PARITY / "model"),
        "datasets": [{"path": str(PARITY / "data" / "alpaca.jsonl"), "type": "alpaca"}],
        "sequence_len": 1024,
        "micro_batch_size": 2,
        "output_dir": str(tmp_path / "out"),
        **fields,
    }
    path = tmp_path / f"cfg{len(list(tmp_path.glob('cfg*.yaml')))}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _widths_train_computes(path: Path, tmp_path, dp: int) -> list[int]:
    """The width of every micro-batch each of ``dp`` ranks computes, from ``train``'s own data
    path (its tokenizer, rows and loader)."""
    from ndparallel.axolotl import load_config
    from ndparallel.layout.dims import ParallelDims
    from ndparallel.training.components import build_data, load_tokenizer, row_widths, train_loader

    cfg = load_config(str(path))
    tokenizer = load_tokenizer(cfg, tmp_path / "cache")
    splits = build_data(cfg, tokenizer, tmp_path / "cache")
    widths = row_widths(cfg, ParallelDims(dp_shard=dp))
    loaders = [train_loader(cfg, splits, tokenizer, r, dp, widths) for r in range(dp)]
    return [len(batch["input_ids"][0]) for loader in loaders for batch in loader]


def test_cut_rows_are_planned_at_the_p95_width_train_computes(capsys, tmp_path, monkeypatch):
    """Unpacked, ``pad_to_sequence_len`` unset (Axolotl's default): each micro-batch is cut after its
    longest row, so the planner's memory and time are at the width 95 % of the micro-batches
    ``train`` computes stay within (from the local data's first records, as the dry run reads
    them), and it says so; padded or packed rows, and a length on the command line, at theirs."""
    import numpy as np

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cut = _alpaca_config(tmp_path)
    code, out, err = run_cli(capsys, "plan", "--config", cut, "--gpus", "2", "--json")
    assert code == 0, err
    widths = _widths_train_computes(cut, tmp_path, dp=2)  # the config's layout at 2 GPUs: FSDP 2
    p95 = int(np.quantile(widths, 0.95, method="inverted_cdf"))
    assert len(widths) == 24 and p95 < max(widths) < 1024, widths  # 48 records, 2 ranks × micro 2
    assert json.loads(out)["request"]["sequence_len"] == p95, err
    assert f"rows: dynamic, p95 {p95} tokens of sequence_len 1024" in err, err
    assert f"memory and time at {p95}" in err, err
    rows = json.loads(out)["rows"]
    assert (rows["planned_at"], rows["dynamic"]) == (p95, True) and f"plan: {rows['said']}\n" in err, rows
    code, out, err = run_cli(
        capsys, "plan", "--config", cut, "--gpus", "64", "--json"
    )  # 48 rows < dp × micro
    assert code == 0 and json.loads(out)["rows"]["planned_at"] == p95, err  # the same widths: one rank's

    written = tmp_path / "planned.yaml"  # the plan at p95, the config written back at its own length
    code, _, err = run_cli(
        capsys, "plan", "--config", cut, "--gpus", "2", "--top", "1", "--write-config", written
    )
    assert code == 0 and yaml.safe_load(written.read_text())["sequence_len"] == 1024, err

    stream = {
        "datasets": None,
        "pretraining_dataset": [{"path": str(PARITY / "data" / "completion.jsonl")}],
        "max_steps": 4,
    }
    for fields, said in [
        ({"sample_packing": True}, "samples packed into rows padded to it"),
        ({"pad_to_sequence_len": True}, "every row padded to it"),
        (stream, "full blocks of the streamed pretraining_dataset"),
    ]:
        code, out, err = run_cli(
            capsys, "plan", "--config", _alpaca_config(tmp_path, **fields), "--gpus", "2", "--json"
        )
        assert code == 0, err
        assert json.loads(out)["request"]["sequence_len"] == 1024, err
        assert f"rows: sequence_len 1024 ({said}" in err and not json.loads(out)["rows"]["dynamic"], err

    code, out, err = run_cli(
        capsys, "plan", "--config", cut, "--gpus", "2", "--json", "--sequence-len", "512"
    )
    assert code == 0 and json.loads(out)["request"]["sequence_len"] == 512 and "rows:" not in err, err
    assert "rows" not in json.loads(out), out[:200]
