"""One vocabulary for a run's options: runtime options -> planner settings -> YAML keys -> runtime
options reproduces every option the planner prices (``plan/settings.py``'s ``UNPRICED`` names the
others and why), and a config ``plan`` writes is one ``ndparallel train --dry-run`` accepts. The
planner's names are the YAML's but for the few ``NAMED_OTHERWISE`` lists, each with its reason."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from cli_helpers import run_cli
from ndparallel.config.fields import FSDPConfig
from ndparallel.config.plan_settings import plan_settings
from ndparallel.config.schema import TrainConfig
from ndparallel.parallel.options import StrategyOptions
from ndparallel.plan.cli.report import config_for
from ndparallel.plan.search.request import SEARCHED, PlanRequest
from ndparallel.plan.settings import NAMED_OTHERWISE, UNPRICED, Settings

ROOT = Path(__file__).resolve().parents[1]
YAML_KEYS = set(TrainConfig.model_fields) | set(FSDPConfig.model_fields)

RUNS = {
    "fsdp-memory": dict(
        dp_shard_size=8,
        fsdp_config=dict(
            reshard_after_forward=False,
            activation_checkpointing=True,
            ac_policy="selective",
            unsharded_grad_accumulation=True,
        ),
        tiled_mlp=True,
        tiled_mlp_num_shards=4,
        activation_offloading=True,
        bf16=True,
        optimizer="adamw_torch_fused",
        sequence_len=8192,
        micro_batch_size=2,
        gradient_accumulation_steps=4,
    ),
    "tp-cp-loss": dict(
        dp_shard_size=2,
        tensor_parallel_size=2,
        context_parallel_size=2,
        sequence_parallel=True,
        loss_parallel=False,
        cp_comm_strategy="allgather",
        chunked_loss=False,
        loss_chunk_tokens=2048,
        fp16=True,
        optimizer="adamw_torch_4bit",
    ),
    "pipeline-qat": dict(
        pipeline_parallel_size=2,
        dp_shard_size=2,
        pipeline_schedule="Interleaved1F1B",
        pipeline_virtual_stages=4,
        fsdp_config=dict(activation_checkpointing=True, unsharded_grad_accumulation=False),
        qat=dict(weight_dtype="int4", activation_dtype="int8", group_size=32),
        optimizer="sgd",
    ),
    "qlora": dict(
        dp_shard_size=4,
        adapter="qlora",
        load_in_4bit=True,
        lora_r=32,
        lora_alpha=64,
        lora_target_linear=True,
        lora_modules_to_save=["embed_tokens", "lm_head"],
        optimizer="adamw_8bit",
        bf16=True,
    ),
}
"""Runs whose options together take a value other than the default for every option the planner
prices (``test_the_runs_move_every_priced_option`` checks it)."""
TRAIN_FIELDS = (
    "sequence_len",
    "micro_batch_size",
    "gradient_accumulation_steps",
    "optimizer",
    "bf16",
    "fp16",
    "adapter",
    "lora_r",
    "load_in_4bit",
    "lora_modules_to_save",
)
"""The training config's priced fields that are no runtime option: the batch, the optimizer, the
precision and the adapter."""
NO_KEY = {"tp.sequence_parallel_saved_shards"}
"""Priced runtime options no training config sets (``NAMED_OTHERWISE``: no YAML key)."""
RESOLVED = {"tp.loss_parallel": True, "loss.chunked": True}
"""Runtime options whose None (auto) the planner prices as the run resolves it for the families it
models (``Settings.from_options``)."""


def _config(run: dict) -> TrainConfig:
    return TrainConfig(base_model="llama-3.1-8b", datasets=[{"path": "builtin:stdlib"}], **run)


def _options(options: StrategyOptions) -> dict:
    """Every runtime option by path (record.field), the planner's unpriced ones left out, the
    values ``RESOLVED`` names resolved."""
    out = {}
    for record in dataclasses.fields(options):
        value = getattr(options, record.name)
        if not dataclasses.is_dataclass(value):
            out[record.name] = str(value)  # the compute dtype
            continue
        if record.name in UNPRICED:
            continue
        for f in dataclasses.fields(value):
            path = f"{record.name}.{f.name}"
            if path not in UNPRICED:
                got = getattr(value, f.name)
                out[path] = RESOLVED.get(path, got) if got is None else got
    return out


def _round_trip(run: dict) -> tuple[TrainConfig, TrainConfig]:
    """The run, and the run the planner's settings of it write back (``plan --write-config``)."""
    cfg = _config(run)
    layout = cfg.parallelism_config().dims
    written = config_for("llama-3.1-8b", layout, plan_settings(cfg))
    return cfg, _config({k: v for k, v in written.items() if k != "base_model"})


@pytest.mark.parametrize("name", RUNS)
def test_runtime_options_survive_the_planner_and_the_yaml(name):
    """runtime options -> ``Settings`` -> YAML keys -> runtime options: the same options."""
    cfg, back = _round_trip(RUNS[name])
    assert _options(back.strategy_options()) == _options(cfg.strategy_options())
    for field in TRAIN_FIELDS:
        assert getattr(back, field) == getattr(cfg, field), field
    assert back.parallelism_config() == cfg.parallelism_config()


def test_the_runs_move_every_priced_option():
    """Not vacuous: each priced runtime option (and training field) differs from its default in
    one of ``RUNS``; and ``UNPRICED`` names only options that exist."""
    default = _options(StrategyOptions())
    moved = set()
    for run in RUNS.values():
        cfg = _config(run)
        moved |= {path for path, value in _options(cfg.strategy_options()).items() if value != default[path]}
        moved |= {f for f in TRAIN_FIELDS if getattr(cfg, f) != TrainConfig.model_fields[f].default}
    assert set(default) | set(TRAIN_FIELDS) == moved | NO_KEY
    records = {r.name: getattr(StrategyOptions(), r.name) for r in dataclasses.fields(StrategyOptions)}
    paths = set(records) | {
        f"{name}.{f.name}"
        for name, rec in records.items()
        if dataclasses.is_dataclass(rec)
        for f in dataclasses.fields(rec)
    }
    assert set(UNPRICED) <= paths


def test_one_name_per_option():
    """The planner's settings carry the training config's names: a ``Settings`` field is a YAML
    key, or ``NAMED_OTHERWISE`` says which key says it (if any) and why the name differs; the
    searched settings are ``Settings`` fields the request pins under the same name."""
    settings = {f.name for f in dataclasses.fields(Settings)}
    assert settings - YAML_KEYS == set(NAMED_OTHERWISE)
    for name, (key, why) in NAMED_OTHERWISE.items():
        assert why and name not in YAML_KEYS, name
        assert key is None or {k.split(":")[0] for k in key.split(", ")} <= YAML_KEYS, key
    request = {f.name for f in dataclasses.fields(PlanRequest)}
    assert set(SEARCHED) <= settings & request


PRICED = (
    "sequence_len",
    "micro_batch_size",
    "gradient_accumulation_steps",
    "activation_checkpointing",
    "ac_policy",
    "reshard_after_forward",
    "unsharded_grad_accumulation",
    "sequence_parallel",
    "loss_parallel",
    "cp_comm_strategy",
    "mixed_precision",
    "optimizer",
)


def test_a_config_plan_writes_runs_train_dry_run(capsys, tmp_path, monkeypatch):
    """``plan --config C --write-config OUT``, then ``train OUT --dry-run``: OUT is a training
    config the run accepts, and the planner reads back the settings of the row it wrote."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out = tmp_path / "planned.yaml"
    argv = ["plan", "--config", ROOT / "examples/gpu/qwen3-8b-fsdp-tp-cp.yaml", "--gpus", "16", "--top", "1"]
    code, text, err = run_cli(capsys, *argv, "--json")
    assert code == 0, err
    row = json.loads(text)["ranked"][0]["best"]["settings"]
    code, _, err = run_cli(capsys, *argv, "--write-config", out)
    assert code == 0, err
    code, dry, err = run_cli(capsys, "train", out, "--dry-run")
    assert code == 0, err
    from ndparallel.axolotl import load_config

    cfg = load_config(str(out))
    s = plan_settings(cfg)
    assert {k: getattr(s, k) for k in PRICED} == {k: row[k] for k in PRICED}
    assert cfg.parallelism_config().total_size == 16 and dry.strip()
