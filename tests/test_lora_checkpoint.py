"""LoRA checkpoints and exports: DCP holds only the adapter (+ its optimizer state), resumes on
another layout, and the exported PEFT adapter (online and from a checkpoint) and the merged model
give the trained model's logits."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import peft  # noqa: F401  (imported once before the ranks fork)
import pytest
import torch

from ndparallel.checkpoint.io import read_dcp_metadata
from ndparallel.runtime.multirank import RankFailure, run_on_ranks

sys.path.insert(0, str(Path(__file__).parent / "scripts"))
import ckpt_train  # noqa: E402

from cli_helpers import run_cli

LORA = dict(r=4, alpha=8, dropout=0.0, target_linear=True)
FSDP2_TP2 = {"dp_shard_size": 2, "tp_size": 2}
ATOL = 2e-5


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(a), 1e-12)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """An uninterrupted LoRA run on one rank (4 steps) and one on FSDP 2 × TP 2 that saves every
    step and stops after step 2."""
    root = tmp_path_factory.mktemp("lora-ckpt")
    ref = run_on_ranks(ckpt_train.train, 1, {}, str(root / "ref"), adapter=LORA)[0]
    part = run_on_ranks(
        ckpt_train.train,
        4,
        FSDP2_TP2,
        str(root / "run"),
        save_every=1,
        stop_after=2,
        adapter=LORA,
        timeout_s=400,
    )[0]
    return {"root": root, "ref": ref, "part": part, "out": root / "run"}


def _base_model():
    from transformers import AutoModelForCausalLM

    setup = ckpt_train.make_setup()
    torch.manual_seed(setup.seed)  # the base model build_model starts from
    return AutoModelForCausalLM.from_config(setup.model_config).float().eval()


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ckpt_train.probe_batch(model.config.vocab_size)).logits


def _peft_logits(adapter_dir: Path) -> torch.Tensor:
    from peft import PeftModel

    return _logits(PeftModel.from_pretrained(_base_model(), str(adapter_dir)).eval())


def test_training_moved_the_logits(runs):
    """Negative control for the logit checks below: the base model alone is far from them."""
    base = _logits(_base_model())
    assert (base - runs["part"]["logits"]).abs().max() > 100 * ATOL
    assert (base - runs["ref"]["logits"]).abs().max() > 100 * ATOL


def test_checkpoint_holds_only_the_adapter(runs):
    keys = read_dcp_metadata(runs["out"] / "checkpoint-2").state_dict_metadata
    model_keys = [k for k in keys if k.startswith("model/")]
    assert model_keys and all(".lora_" in k for k in model_keys)
    state_keys = [k for k in keys if k.startswith("optimizer/state/")]
    assert state_keys and all(".lora_" in k for k in state_keys)  # no optimizer state for the base
    assert (runs["out"] / "checkpoint-2" / "hf" / "adapter_config.json").is_file()


@pytest.mark.parametrize("world,layout", [(2, {"tp_size": 2}), (1, {})], ids=["tp2", "one-rank"])
def test_resume_on_other_layout(runs, tmp_path, world, layout):
    out = tmp_path / "run"
    shutil.copytree(runs["out"], out)
    res = run_on_ranks(ckpt_train.train, world, layout, str(out), resume=True, adapter=LORA)[0]
    assert list(res["losses"]) == [3, 4]
    for step in (3, 4):
        assert _rel(runs["ref"]["losses"][step], res["losses"][step]) <= 1e-5, (step, res["losses"])
    assert (res["logits"] - runs["ref"]["logits"]).abs().max() <= ATOL


def test_losses_before_the_save_equal_one_process(runs):
    for step in (1, 2):
        assert _rel(runs["ref"]["losses"][step], runs["part"]["losses"][step]) <= 1e-5


@pytest.mark.parametrize("run", ["ref", "part"], ids=["one-rank", "fsdp2xtp2"])
def test_exported_adapter_loads_with_peft(runs, run):
    out = runs["root"] / ("ref" if run == "ref" else "run") / "adapter"
    assert {p.name for p in out.iterdir()} >= {"adapter_config.json", "adapter_model.safetensors"}
    assert (_peft_logits(out) - runs[run]["logits"]).abs().max() <= ATOL


def test_merged_model_gives_the_same_logits(runs):
    from transformers import AutoModelForCausalLM

    merged = AutoModelForCausalLM.from_pretrained(str(runs["out"] / "merged")).eval()
    assert not any("lora" in n for n, _ in merged.named_parameters())
    assert (_logits(merged) - runs["part"]["logits"]).abs().max() <= ATOL


def test_offline_export_of_a_lora_checkpoint(runs, tmp_path):
    from ndparallel.checkpoint.export import export_checkpoint

    out = export_checkpoint(runs["out"] / "checkpoint-2", tmp_path / "adapter")
    assert (_peft_logits(out) - runs["part"]["logits"]).abs().max() <= ATOL


def test_lora_checkpoint_into_a_full_model_is_refused(runs, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(runs["out"], out)
    with pytest.raises(RankFailure, match="does not fit this model"):
        run_on_ranks(ckpt_train.train, 1, {}, str(out), resume=True)


# ------------------------------------------------------------------ offline merge (export --merge)
@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    """The run's (seeded, random) base model on disk: what --merge reads tensor by tensor."""
    path = tmp_path_factory.mktemp("base")
    _base_model().save_pretrained(str(path))
    return path


@pytest.mark.parametrize("source", ["checkpoint", "adapter_dir"])
def test_offline_merge_equals_the_online_merge(runs, base_dir, tmp_path, capsys, source):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    src = runs["out"] / ("checkpoint-2" if source == "checkpoint" else "adapter")
    out = tmp_path / "merged"
    code, _, err = run_cli(
        capsys, "export", src, out, "--merge", "--base", base_dir, "--max-shard-size", "100KB"
    )
    assert code == 0, err
    assert (out / "model.safetensors.index.json").is_file()  # streamed into several shards
    merged = AutoModelForCausalLM.from_pretrained(str(out)).eval()
    assert not any("lora" in n for n, _ in merged.named_parameters())
    assert (_logits(merged) - runs["part"]["logits"]).abs().max() <= ATOL
    online = load_file(str(runs["out"] / "merged" / "model.safetensors"))
    offline = {k: v for f in out.glob("*.safetensors") for k, v in load_file(str(f)).items()}
    assert set(online) <= set(offline)
    assert max((online[k] - offline[k]).abs().max().item() for k in online) <= 1e-6


def test_offline_merge_refusals(runs, tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    from ndparallel.models.presets import preset_config

    ckpt = runs["out"] / "checkpoint-2"
    cases = [
        ((ckpt, tmp_path / "a", "--merge"), "pass --base DIR"),  # the run's base is a preset config
        ((ckpt, tmp_path / "b", "--base", tmp_path), "--base is the base model of --merge"),
        ((runs["out"] / "adapter", tmp_path / "c"), "is a PEFT adapter directory: add --merge"),
    ]
    other = tmp_path / "other_base"  # another model size: the adapter does not fit it
    cfg = preset_config("tiny-llama")
    cfg.hidden_size, cfg.intermediate_size = 32, 64
    AutoModelForCausalLM.from_config(cfg).save_pretrained(str(other))
    capsys.readouterr()  # transformers' progress bar
    cases.append(((ckpt, tmp_path / "d", "--merge", "--base", other), "has shape"))
    for args, fragment in cases:
        code, _, err = run_cli(capsys, "export", *args)
        assert code == 2 and fragment in err, (args, err)
        assert len(err.strip().splitlines()) == 1, err
        assert not Path(args[1]).exists() or not any(Path(args[1]).iterdir()), args  # nothing written
