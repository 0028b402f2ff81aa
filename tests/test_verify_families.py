"""``ndparallel verify`` on checkpoints transformers saved, of the families issue 47 found it wrong
on: a correct layout passes (Gemma 4's unit-scaled QK-norm attention under CP 2, whose rounding is
the largest of the family matrix; GPT-NeoX, whose config names differ, under FSDP 2 × TP 2), and a
skipped gradient sync still fails on the same model."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers

import faults
from ndparallel.tools.shrink import shrink_model

ROOT = Path(__file__).resolve().parents[1]


def _saved(tmp_path: Path, cls: str) -> str:
    config = shrink_model(getattr(transformers, cls)(), tp_size=2, cp_size=2).config
    torch.manual_seed(0)
    out = tmp_path / cls
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(out)
    return str(out)


def _verify(example: str, model: str) -> int:
    from ndparallel.cli.commands import run_verify

    return run_verify([f"examples/cpu/{example}", "--steps", "3", f"--set=base_model={model}"])


def test_gemma4_cp2_and_fsdp2_pass_and_name_their_bound(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    model = _saved(tmp_path, "Gemma4TextConfig")
    for example in ("cp.yaml", "fsdp.yaml"):
        assert _verify(example, model) == 0, example
        out = " ".join(capsys.readouterr().out.split())  # the verdict as one line, however rich wrapped it
        assert "PASS" in out and "of its bound" in out and "(sqrt(head_dim 16)" in out, out[-2000:]
        assert "Failed to load" not in out and "Enum subclass" not in out  # no library noise


def test_gpt_neox_fsdp2_tp2_passes_and_a_skipped_sync_fails(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    model = _saved(tmp_path, "GPTNeoXConfig")
    assert _verify("fsdp_tp.yaml", model) == 0
    assert "PASS" in capsys.readouterr().out
    faults.unrecorded(monkeypatch)
    faults.skip_grad_sync(monkeypatch)
    assert _verify("fsdp_tp.yaml", model) == 1
    assert "FAIL" in capsys.readouterr().out
