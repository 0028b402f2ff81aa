"""The planner's LoRA model (``plan --adapter lora``): adapter sizes equal PEFT's and the runtime's
shards, states and gradient traffic are the adapters', the CLI ranks layouts a full fine-tune
cannot fit."""

from __future__ import annotations

import peft  # noqa: F401  (imported once before the ranks fork)
import pytest
import torch
import yaml

from ndparallel.config import TrainConfig
from ndparallel.layout.dims import ParallelDims
from ndparallel.models.presets import preset_config, published_config
from ndparallel.plan.adapters.lora_cost import adapter_shard_numel, trainable_params
from ndparallel.plan.cli.main import main
from ndparallel.plan.hardware import PRESETS as HW
from ndparallel.plan.memory.peak import estimate_memory
from ndparallel.plan.models import PRESETS
from ndparallel.plan.settings import Settings
from ndparallel.plan.time.comms import collectives_for
from ndparallel.testing import run_on_ranks

TINY = PRESETS["tiny"]  # = the tiny-llama preset
H100 = HW["h100-80gb"]


def _peft_trainable(config, r: int) -> int:
    from transformers import AutoModelForCausalLM

    from ndparallel.models.adapters import apply_adapter, lora_config

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    model = apply_adapter(model, lora_config(r=r, target_linear=True))
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


@pytest.mark.parametrize(
    "preset, config",
    [
        ("tiny", lambda: preset_config("tiny-llama")),
        ("llama-3.1-8b", lambda: published_config("llama-3.1-8b")),
    ],
)
def test_trainable_params_equal_peft(preset, config):
    assert trainable_params(PRESETS[preset], 16) == _peft_trainable(config(), 16)


def _local_adapter_numel(layout: dict) -> int:
    from ndparallel import Accelerator, ParallelismConfig
    from ndparallel.models.adapters import lora_config

    acc = Accelerator(ParallelismConfig(**layout))
    model = acc.load_model("tiny-llama", adapter=lora_config(r=4, target_linear=True))
    return sum(
        (p.to_local() if hasattr(p, "to_local") else p).numel()
        for n, p in model.named_parameters()
        if ".lora_" in n
    )


def test_adapter_shard_equals_the_runtime_shard():
    got = run_on_ranks(_local_adapter_numel, 4, {"dp_shard_size": 2, "tp_size": 2}, timeout_s=300)
    assert set(got) == {adapter_shard_numel(TINY, ParallelDims(dp_shard=2, tp=2), 4)}


def test_lora_states_are_the_adapters():
    # gradients kept allocated between steps (set_to_none=False), so they count at every moment
    full = estimate_memory(TINY, ParallelDims(dp_shard=2), Settings(sequence_len=32, set_to_none=False), H100)
    lora = estimate_memory(
        TINY, ParallelDims(dp_shard=2), Settings(sequence_len=32, lora_r=4, set_to_none=False), H100
    )
    adapter = adapter_shard_numel(TINY, ParallelDims(dp_shard=2), 4)
    assert lora.params == full.params / 4 * 2 + adapter * 4  # bf16 frozen base + fp32 adapters
    assert lora.grads == adapter * 4 and lora.optimizer == adapter * 8
    assert lora.activations == full.activations
    assert lora.total < full.total


def test_lora_gradient_traffic():
    s = Settings(sequence_len=32, lora_r=4, mixed_precision="fp32", sequence_parallel=False)
    cs = collectives_for(TINY, ParallelDims(dp_shard=2, tp=2), s)
    rs = [c for c in cs if c.kind == "reduce_scatter"]
    assert len(rs) == 1 and "LoRA" in rs[0].what  # the frozen embedding / head reduce nothing
    # one tp all-reduce of r·hidden fp32 per adapted linear: what tests/test_lora_tp.py measures
    lora_tp = [c for c in cs if "LoRA replicated-factor" in c.what]
    assert [(c.bytes, c.count) for c in lora_tp] == [(4 * 64 * 4, 14)]


def test_cli_lora_fits_where_full_fine_tuning_does_not(tmp_path, capsys):
    args = ["--base-model", "llama-3.1-8b", "--gpus", "1", "--gpu", "h100-80gb", "--sequence-len", "4096"]
    assert main(args) == 1  # full fine-tuning of 8B on one 80 GB GPU: no fit
    out_yaml = tmp_path / "lora.yaml"
    assert main([*args, "--adapter", "lora", "--lora-r", "8", "--write-config", str(out_yaml)]) == 0
    assert "LoRA r=8 on every linear: 21.0M trainable" in capsys.readouterr().out
    cfg = TrainConfig.model_validate(yaml.safe_load(out_yaml.read_text()))
    assert (cfg.adapter, cfg.lora_r, cfg.lora_target_linear) == ("lora", 8, True)


def test_cli_lora_r_without_adapter_is_one_line(capsys):
    assert main(["--base-model", "tiny", "--gpus", "1", "--lora-r", "8"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "ndparallel plan: error: --lora-r needs --adapter lora (or qlora)"


def _local_copy_numel(layout: dict) -> int:
    from ndparallel import Accelerator, ParallelismConfig
    from ndparallel.models.adapters import SAVED_COPY, lora_config

    acc = Accelerator(ParallelismConfig(**layout))
    adapter = lora_config(r=4, target_linear=True, modules_to_save=["embed_tokens", "lm_head"])
    model = acc.load_model("tiny-llama", adapter=adapter)
    seen = {
        id(p): (p.to_local() if hasattr(p, "to_local") else p).numel()
        for n, p in model.named_parameters()
        if SAVED_COPY in n and p.requires_grad
    }
    return sum(seen.values())


def test_modules_to_save_copies_equal_the_runtime_shards():
    """``lora_modules_to_save: [embed_tokens, lm_head]``: one trained vocab × hidden copy per table,
    FSDP-sharded, as the runtime holds them on each rank."""
    from ndparallel.plan.adapters.lora_cost import saved_copy_shard_numel, saved_copy_units

    got = run_on_ranks(_local_copy_numel, 2, {"dp_shard_size": 2}, timeout_s=300)
    layout = ParallelDims(dp_shard=2)
    assert saved_copy_units(TINY, ("embed", "head")) == ("embed", "final")
    assert set(got) == {2 * saved_copy_shard_numel(TINY, layout)} and got[0] > 0


def test_modules_to_save_states_grads_and_traffic():
    s = Settings(sequence_len=32, lora_r=4, set_to_none=False)
    saved = Settings(**{**s.__dict__, "lora_saved": ("embed", "head")})
    layout = ParallelDims(dp_shard=2)
    lora, with_copies = estimate_memory(TINY, layout, s, H100), estimate_memory(TINY, layout, saved, H100)
    copies = 2 * -(-TINY.vocab // 2) * TINY.hidden  # two tables, half the vocab rows each
    assert with_copies.params - lora.params == copies * 4  # fp32 masters
    assert (
        with_copies.grads - lora.grads == copies * 4 and with_copies.optimizer - lora.optimizer == copies * 8
    )
    rs = [c for c in collectives_for(TINY, layout, saved) if c.kind == "reduce_scatter"]
    assert sorted(c.what for c in rs if "trained copy" in c.what) == [
        "FSDP reduce-scatter grads (embed), trained copy",
        "FSDP reduce-scatter grads (final), trained copy",
    ]
    assert all(
        c.bytes == copies / 2 * 2 * 4 for c in rs if "trained copy" in c.what
    )  # one table, n × shard, fp32
    tied = PRESETS["llama-3.2-1b"]
    one = estimate_memory(tied, layout, Settings(**{**saved.__dict__, "sequence_len": 128}), H100)
    base = estimate_memory(tied, layout, Settings(**{**s.__dict__, "sequence_len": 128}), H100)
    assert one.params - base.params == -(-tied.vocab // 2) * tied.hidden * 4  # tied: one copy


def test_cli_modules_to_save_rejects_tp_and_round_trips_a_config(tmp_path, capsys):
    import json

    args = [
        "--base-model",
        "llama-3.1-8b",
        "--gpus",
        "8",
        "--adapter",
        "lora",
        "--lora-modules-to-save",
        "embed_tokens,lm_head",
    ]
    assert main([*args, "--json", "--show-rejected"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert all(r["layout"]["tp"] == 1 for r in result["ranked"])
    assert any(c["code"] == "lora_layout" for r in result["rejected"] for c in r["rejections"])
    out_yaml = tmp_path / "saved.yaml"
    assert main([*args, "--top", "1", "--write-config", str(out_yaml)]) == 0
    assert "trained copies of embed_tokens and lm_head" in capsys.readouterr().out
    cfg = TrainConfig.model_validate(yaml.safe_load(out_yaml.read_text()))
    assert cfg.lora_modules_to_save == ["embed_tokens", "lm_head"]
    assert main(["--base-model", "tiny", "--gpus", "1", "--lora-modules-to-save", "lm_head"]) == 2
    assert "needs --adapter lora" in capsys.readouterr().err
