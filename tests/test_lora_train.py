"""`ndparallel train` with `adapter: lora`: bad LoRA fields are one line before launch, the dry
run shows the adapter, and a run writes a PEFT adapter and a merged model that agree."""

from __future__ import annotations

from pathlib import Path

import peft  # noqa: F401  (imported once before the ranks fork)
import pytest
import torch

from cli_helpers import run_cli
from ndparallel.axolotl import load_config
from ndparallel.testing import run_on_ranks

ROOT = Path(__file__).resolve().parents[1]


def _yaml(tmp_path, text):
    p = tmp_path / "cfg.yaml"
    p.write_text("base_model: tiny-llama\n" + text)
    return str(p)


def test_lora_fields_without_adapter_are_a_note_on_a_full_fine_tune(tmp_path, capsys):
    """Axolotl's full fine-tuning configs often keep lora_* fields with no adapter; Axolotl ignores
    them, and so does ndparallel, saying so before launch."""
    code, out, err = run_cli(
        capsys, "train", _yaml(tmp_path, "lora_r: 16\nlora_target_linear: true\n"), "--dry-run"
    )
    assert code == 0, err
    assert "lora_r, lora_target_linear set but no adapter: not used, every parameter is trained" in out
    assert "adapter      :" not in out


@pytest.mark.parametrize(
    "text, fragment",
    [
        ("adapter: qlora\n", "adapter: qlora needs load_in_4bit: true"),
        ("adapter: lora\nlora_r: 0\n", "'lora_r': must be >= 1, got 0"),
        ("adapter: lora\nlora_dropout: 1.5\n", "'lora_dropout': must be < 1"),
        ("adapter: lora\nlora_target_modules: [q_projj]\n", "lora_target_modules=['q_projj']"),
        (
            "adapter: lora\nlora_target_modules: [embed_tokens, q_proj]\ntensor_parallel_size: 2\n",
            "model.embed_tokens (Embedding): with tensor_parallel_size > 1 LoRA adapts linear layers only",
        ),
        ("adapter: lora\nlora_rank: 8\n", "unknown key 'lora_rank'; did you mean 'lora_r'?"),
    ],
)
def test_bad_lora_config_is_one_line(tmp_path, capsys, text, fragment):
    code, _, err = run_cli(capsys, "train", _yaml(tmp_path, text), "--dry-run")
    assert code == 2, err
    assert fragment in err, err
    assert len(err.strip().splitlines()) == 1, err


def test_dry_run_shows_the_adapter(tmp_path, capsys):
    code, out, err = run_cli(
        capsys, "train", _yaml(tmp_path, "adapter: lora\nlora_target_modules: q_proj\n"), "--dry-run"
    )
    assert code == 0, err
    assert "adapter      : LoRA r=8 alpha=16 dropout=0 on 2 layers (q_proj)" in out


def _train(overrides):
    from ndparallel.training.trainer import run_training

    run_training(load_config(str(ROOT / "examples/cpu/lora_fsdp_tp.yaml"), overrides))
    return True


def test_train_writes_an_adapter_and_a_merged_model_that_agree(tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    out = tmp_path / "run"
    run_on_ranks(
        _train,
        2,
        [
            f"output_dir={out}",
            f"dataset_cache_dir={tmp_path / 'cache'}",
            "max_steps=3",
            "save_steps=3",
            "tensor_parallel_size=1",
            "datasets=[{path: 'builtin:stdlib', max_bytes: 200000}]",
        ],
        timeout_s=400,
    )
    merged = AutoModelForCausalLM.from_pretrained(out / "merged").eval()
    torch.manual_seed(42)  # the preset's random base: the run's seed, as load_model draws it
    base = AutoModelForCausalLM.from_config(merged.config).float()
    ids = torch.randint(0, merged.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        base_logits = base(input_ids=ids).logits
        lora = PeftModel.from_pretrained(base, out / "final").eval()
        a, b = lora(input_ids=ids).logits, merged(input_ids=ids).logits
    assert (a - b).abs().max() <= 2e-5
    assert (a - base_logits).abs().max() > 1e-3  # the adapter learned something
    assert sorted(p.name for p in (out / "checkpoint-3").iterdir() if p.name.endswith(".distcp"))
