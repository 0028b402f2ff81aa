"""One pre-launch pass builds ``base_model``'s meta-device model once and its checks share it
(``Preflight.meta_model``): a ``--dry-run`` of a TP layout asked for it five times, ~0.04 s each
(0.33 → 0.16 s a dry run). A check that changes a model (the adapter's) builds its own, and the
shared one is built again when ``local inputs`` grows the vocabulary, which later checks see."""

from __future__ import annotations

from pathlib import Path

import ndparallel.preflight.model_check as model_check
from cli_helpers import run_cli
from ndparallel.axolotl import load_config
from ndparallel.preflight.checks import Preflight, run_checks

SEED = Path(__file__).parent / "fixtures" / "axolotl" / "llama-3_1-8b-hsdp-tp.yaml"


def _counted_builds(monkeypatch) -> list:
    built = []
    real = model_check.meta_model

    def counting(cfg, hf):
        built.append(hf)
        return real(cfg, hf)

    monkeypatch.setattr(model_check, "meta_model", counting)
    return built


def test_a_dry_run_builds_the_meta_model_once(monkeypatch, capsys):
    built = _counted_builds(monkeypatch)
    code, out, err = run_cli(capsys, "train", SEED, "--dry-run")
    assert code == 0, err
    assert "tp plan      :" in out and "chunked loss on" in out  # lines that read the meta model
    assert len(built) == 1


def test_the_checks_share_it_and_an_adapter_builds_its_own(monkeypatch):
    built = _counted_builds(monkeypatch)
    run_checks(load_config(SEED), 16, check_local=False)
    assert len(built) == 1
    built.clear()
    run_checks(load_config(SEED, ["adapter=lora"]), 16, check_local=False)
    assert len(built) == 2  # the shared one, and the adapter check's (LoRA layers added to it)


def test_a_grown_vocabulary_builds_it_again():
    cfg = load_config(SEED)
    p = Preflight(cfg, 16, check_local=False)
    p.hf = model_check.resolve_model_config(cfg)
    first = p.meta_model()
    assert p.meta_model() is first
    p.hf.vocab_size += 64  # what local inputs does for tokens new to the vocabulary
    again = p.meta_model()
    assert again is not first
    assert again.get_input_embeddings().num_embeddings == first.get_input_embeddings().num_embeddings + 64
