"""The planner's LoRA model (``plan --adapter lora``): adapter sizes equal PEFT's and the runtime's
shards, states and gradient traffic are the adapters', the CLI ranks layouts a full fine-tune
cannot fit."""

from __future__ import annotations

import peft  # noqa: F401  (imported once before the ranks fork)
import pytest
import torch
import yaml

from ndparallel.models.presets import preset_config, published_config
from ndparallel.plan.adapter import adapter_shard_numel, trainable_params
from ndparallel.plan.cli import main
from ndparallel.plan.comms import collectives_for
from ndparallel.plan.hardware import PRESETS as HW
from ndparallel.plan.layout import Layout, Settings
from ndparallel.plan.memory import estimate_memory
from ndparallel.plan.models import PRESETS
from ndparallel.testing import run_on_ranks
from ndparallel.training.config import TrainConfig

TINY = PRESETS["tiny"]  # = the tiny-llama preset
H100 = HW["h100-80gb"]


def _peft_trainable(config, r: int) -> int:
    from transformers import AutoModelForCausalLM

    from ndparallel.models.adapters import apply_adapter, lora_config

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    model = apply_adapter(model, lora_config(r=r, target_linear=True))
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


@pytest.mark.parametrize("preset, config", [("tiny", lambda: preset_config("tiny-llama")),
                                            ("llama-3.1-8b", lambda: published_config("llama-3.1-8b"))])
def test_trainable_params_equal_peft(preset, config):
    assert trainable_params(PRESETS[preset], 16) == _peft_trainable(config(), 16)


def _local_adapter_numel(layout: dict) -> int:
    from ndparallel import Accelerator, ParallelismConfig
    from ndparallel.models.adapters import lora_config

    acc = Accelerator(ParallelismConfig(**layout))
    model = acc.load_model("tiny-llama", adapter=lora_config(r=4, target_linear=True))
    return sum((p.to_local() if hasattr(p, "to_local") else p).numel()
               for n, p in model.named_parameters() if ".lora_" in n)


def test_adapter_shard_equals_the_runtime_shard():
    got = run_on_ranks(_local_adapter_numel, 4, {"dp_shard_size": 2, "tp_size": 2}, timeout_s=300)
    assert set(got) == {adapter_shard_numel(TINY, Layout(dp_shard=2, tp=2), 4)}


def test_lora_states_are_the_adapters():
    # gradients kept allocated between steps (set_to_none=False), so they count at every moment
    full = estimate_memory(TINY, Layout(dp_shard=2), Settings(seq_len=32, set_to_none=False), H100)
    lora = estimate_memory(TINY, Layout(dp_shard=2), Settings(seq_len=32, lora_r=4, set_to_none=False), H100)
    adapter = adapter_shard_numel(TINY, Layout(dp_shard=2), 4)
    assert lora.params == full.params / 4 * 2 + adapter * 4  # bf16 frozen base + fp32 adapters
    assert lora.grads == adapter * 4 and lora.optimizer == adapter * 8
    assert lora.activations == full.activations
    assert lora.total < full.total


def test_lora_gradient_traffic():
    s = Settings(seq_len=32, lora_r=4, mixed_precision="fp32", sequence_parallel=False)
    cs = collectives_for(TINY, Layout(dp_shard=2, tp=2), s)
    rs = [c for c in cs if c.kind == "reduce_scatter"]
    assert len(rs) == 1 and "LoRA" in rs[0].what  # the frozen embedding / head reduce nothing
    # one tp all-reduce of r·hidden fp32 per adapted linear: what tests/test_lora_tp.py measures
    lora_tp = [c for c in cs if "LoRA replicated-factor" in c.what]
    assert [(c.bytes, c.count) for c in lora_tp] == [(4 * 64 * 4, 14)]


def test_cli_lora_fits_where_full_fine_tuning_does_not(tmp_path, capsys):
    args = ["--model", "llama-3.1-8b", "--gpus", "1", "--gpu", "h100-80gb", "--seq-len", "4096"]
    assert main(args) == 1  # full fine-tuning of 8B on one 80 GB GPU: no fit
    out_yaml = tmp_path / "lora.yaml"
    assert main([*args, "--adapter", "lora", "--lora-r", "8", "--write-config", str(out_yaml)]) == 0
    assert "LoRA r=8 on every linear: 21.0M trainable" in capsys.readouterr().out
    cfg = TrainConfig.model_validate(yaml.safe_load(out_yaml.read_text()))
    assert (cfg.adapter, cfg.lora_r, cfg.lora_target_linear) == ("lora", 8, True)


def test_cli_lora_r_without_adapter_is_one_line(capsys):
    assert main(["--model", "tiny", "--gpus", "1", "--lora-r", "8"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "ndparallel plan: error: --lora-r needs --adapter lora (or qlora)"
