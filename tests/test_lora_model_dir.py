"""Starting from a saved PEFT adapter (Axolotl's ``lora_model_dir``): on FSDP2 × TP2 the model is the
one PEFT's own ``PeftModel.from_pretrained`` builds on one process (same loss, same adapter tensors);
a run continues from another run's adapter on another layout; a directory that does not fit is one
line before any rank starts."""

from __future__ import annotations

import json
from pathlib import Path

import peft  # noqa: F401  (imported once before the ranks fork)
import pytest
import torch

from cli_helpers import run_cli
from ndparallel.axolotl import load_config
from ndparallel.models.presets import preset_config
from ndparallel.testing import run_on_ranks

ROOT = Path(__file__).resolve().parents[1]
IDS = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))


def _save_base_and_adapter(base_dir: str, adapter_dir: str, r: int = 4) -> None:
    """A tiny base and a PEFT adapter over it whose A and B are both random (so it changes the model)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(3)
    base = AutoModelForCausalLM.from_config(preset_config("tiny-llama"))
    base.save_pretrained(base_dir)
    config = LoraConfig(r=r, lora_alpha=2 * r, target_modules="all-linear", init_lora_weights=False)
    get_peft_model(base, config).save_pretrained(adapter_dir)


def _peft_reference(base_dir: str, adapter_dir: str) -> dict:
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_dir)
    plain = float(base(input_ids=IDS, labels=IDS).loss)
    model = PeftModel.from_pretrained(base, adapter_dir, is_trainable=True)
    return {
        "loss": float(model(input_ids=IDS, labels=IDS).loss),
        "base_loss": plain,
        "saved": load_file(f"{adapter_dir}/adapter_model.safetensors"),
    }


def _ours(base_dir: str, adapter_dir: str, layout: dict) -> dict:
    from ndparallel import Accelerator, ParallelismConfig
    from ndparallel.models.adapter_files import read_adapter_config
    from ndparallel.models.adapters import peft_save_key

    acc = Accelerator(ParallelismConfig(**layout))
    model = acc.load_model(base_dir, adapter=read_adapter_config(adapter_dir), adapter_weights=adapter_dir)
    adapters = {}
    for name, p in model.named_parameters():
        if ".lora_" in name:
            t = p.full_tensor() if hasattr(p, "full_tensor") else p
            adapters[peft_save_key(name)] = t.detach().clone()
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    return {
        "loss": float(model(input_ids=IDS, labels=IDS).loss),
        "adapters": adapters,
        "all_trainable_are_adapters": all(".lora_" in n for n in trainable) and bool(trainable),
    }


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_model_dir")
    base, adapter = str(root / "base"), str(root / "adapter")
    run_on_ranks(_save_base_and_adapter, 1, base, adapter)
    return base, adapter


def test_loaded_adapter_on_fsdp2_tp2_is_peft_own_loading(saved):
    base, adapter = saved
    ref = run_on_ranks(_peft_reference, 1, base, adapter)[0]
    got = run_on_ranks(_ours, 4, base, adapter, {"dp_shard_size": 2, "tp_size": 2}, timeout_s=400)[0]
    assert set(got["adapters"]) == set(ref["saved"])
    for key, t in ref["saved"].items():
        assert torch.equal(got["adapters"][key], t), key
    assert abs(got["loss"] - ref["loss"]) <= 1e-5 * abs(ref["loss"]), (got["loss"], ref["loss"])
    assert abs(ref["loss"] - ref["base_loss"]) > 1e-3  # the adapter changes the model: the check can fail
    assert got["all_trainable_are_adapters"]


def _train(overrides):
    from ndparallel.training.trainer import run_training

    run_training(load_config(str(ROOT / "examples/cpu/lora_fsdp_tp.yaml"), overrides))
    return True


def test_a_run_continues_from_another_runs_adapter_on_another_layout(tmp_path):
    from safetensors.torch import load_file

    common = [
        f"dataset_cache_dir={tmp_path / 'cache'}",
        "merge_lora=false",
        "datasets=[{path: 'builtin:stdlib', max_bytes: 200000}]",
    ]
    first, second = tmp_path / "first", tmp_path / "second"
    run_on_ranks(
        _train,
        2,
        [f"output_dir={first}", "max_steps=3", "save_steps=3", "tensor_parallel_size=1", *common],
        timeout_s=400,
    )
    # lr ~0: the second run's adapter stays the one it started from (a fresh init would be B = 0)
    run_on_ranks(
        _train,
        2,
        [
            f"output_dir={second}",
            "max_steps=1",
            "save_steps=1",
            "dp_shard_size=1",
            f"lora_model_dir={first / 'final'}",
            "learning_rate=1e-12",
            "warmup_steps=0",
            *common,
        ],
        timeout_s=400,
    )
    a = load_file(first / "final" / "adapter_model.safetensors")
    b = load_file(second / "final" / "adapter_model.safetensors")
    assert set(a) == set(b)
    assert all((a[k] - b[k]).abs().max() <= 1e-6 for k in a)
    assert any(k.endswith("lora_B.weight") and a[k].abs().max() > 1e-6 for k in a)


def _yaml(tmp_path, base: str, text: str) -> str:
    p = tmp_path / "cfg.yaml"
    p.write_text(
        f"base_model: {base}\nadapter: lora\ndatasets: [{{path: data.jsonl, type: alpaca}}]\n" + text
    )
    return str(p)


def _without(adapter: str, tmp_path, name: str) -> str:
    import shutil

    copy = tmp_path / "partial"
    shutil.copytree(adapter, copy)
    (copy / name).unlink()
    return str(copy)


def _other_r(adapter: str, tmp_path) -> str:
    """The same directory with a config that claims r 8: the tensors (r 4) no longer fit."""
    import shutil

    copy = tmp_path / "other_r"
    shutil.copytree(adapter, copy)
    cfg = json.loads((copy / "adapter_config.json").read_text())
    cfg.update(r=8, lora_alpha=8)
    (copy / "adapter_config.json").write_text(json.dumps(cfg))
    return str(copy)


@pytest.mark.parametrize(
    "case, fragment",
    [
        ("missing", "is not a directory"),
        ("no_weights", "has no adapter_model.safetensors"),
        ("no_config", "has no adapter_config.json"),
        ("r_mismatch", "lora_r=16 but the adapter in"),
        ("targets_mismatch", "lora_target_modules / lora_target_linear adapt 2 layers, the adapter"),
        ("shapes", "has shape [4, 64], the model needs [8, 64]"),
    ],
)
def test_a_bad_lora_model_dir_is_one_line_before_launch(saved, tmp_path, capsys, case, fragment):
    base, adapter = saved
    text = {  # built lazily: each case writes its own copy
        "missing": lambda: f"lora_model_dir: {tmp_path / 'nope'}\n",
        "no_weights": lambda: f"lora_model_dir: {_without(adapter, tmp_path, 'adapter_model.safetensors')}\n",
        "no_config": lambda: f"lora_model_dir: {_without(adapter, tmp_path, 'adapter_config.json')}\n",
        "r_mismatch": lambda: f"lora_model_dir: {adapter}\nlora_r: 16\n",
        "targets_mismatch": lambda: f"lora_model_dir: {adapter}\nlora_target_modules: [q_proj]\n",
        "shapes": lambda: f"lora_model_dir: {_other_r(adapter, tmp_path)}\n",
    }[case]()
    code, _, err = run_cli(capsys, "train", _yaml(tmp_path, base, text), "--dry-run")
    assert code == 2, err
    assert fragment in err, err
    assert len(err.strip().splitlines()) == 1, err


def test_dry_run_names_the_saved_adapter(saved, tmp_path, capsys):
    base, adapter = saved
    code, out, err = run_cli(
        capsys, "train", _yaml(tmp_path, base, f"lora_model_dir: {adapter}\n"), "--dry-run"
    )
    assert code == 0, err
    assert "LoRA r=4 alpha=8 dropout=0 on 14 layers" in out and f"starts from {adapter}" in out, out
