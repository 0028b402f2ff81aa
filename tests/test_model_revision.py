"""``revision_of_model`` (Axolotl's; alias ``model_revision``): a Hub base_model's config, weights and
tokenizer all come from that revision. Proven offline on a Hugging Face cache holding two revisions
of one repository (main: 2 layers, an older commit: 1 layer)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from cli_helpers import forbid_launch, run_cli
from sft_fixtures import alpaca_records, llama3_tokenizer, write_jsonl

OLD, NEW = "ab" * 20, "cd" * 20
REPO = "tiny-org/tiny-llama"


def _snapshot(root: Path, commit: str, layers: int) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = llama3_tokenizer()
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=512,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
    )
    folder = root / f"models--{REPO.replace('/', '--')}" / "snapshots" / commit
    LlamaForCausalLM(config).save_pretrained(folder)
    tok.save_pretrained(folder)


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory):
    root = tmp_path_factory.mktemp("hub")
    _snapshot(root, OLD, layers=1)
    _snapshot(root, NEW, layers=2)
    refs = root / f"models--{REPO.replace('/', '--')}" / "refs"
    refs.mkdir()
    (refs / "main").write_text(NEW)
    return root


def _run(hub_cache: Path, tmp_path: Path, extra: str, *args: str) -> subprocess.CompletedProcess:
    tmp_path.mkdir(parents=True, exist_ok=True)
    data = write_jsonl(tmp_path / "a.jsonl", alpaca_records(16))
    cfg = tmp_path / "c.yaml"
    cfg.write_text(
        f"base_model: {REPO}\nsequence_len: 256\nmicro_batch_size: 2\nmax_steps: 1\n"
        f"output_dir: {tmp_path / 'out'}\ndatasets: [{{path: {data}, type: alpaca}}]\n" + extra
    )
    env = {**os.environ, "HF_HUB_CACHE": str(hub_cache), "HF_HUB_OFFLINE": "1", "NDPARALLEL_DEVICE": "cpu"}
    return subprocess.run(
        [sys.executable, "-m", "ndparallel", "train", str(cfg), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.timeout(300)  # a real multi-rank launch, 40-95 s on 2 cores: over the 120 s default budget
def test_the_pinned_revision_is_what_trains(hub_cache, tmp_path):
    main = _run(hub_cache, tmp_path / "main", "", "--dry-run")
    assert main.returncode == 0, main.stderr
    assert f"model        : {REPO} (llama, 2 layers" in main.stdout
    run = _run(
        hub_cache,
        tmp_path / "train",
        f"model_revision: {OLD}\nadapter: lora\nlora_r: 2\nlora_target_linear: true\n",
    )  # Axolotl's other name; a LoRA run on the old commit
    assert run.returncode == 0, run.stderr[-3000:]
    import json

    final = tmp_path / "train" / "out" / "final"
    adapter = json.loads((final / "adapter_config.json").read_text())
    assert (adapter["base_model_name_or_path"], adapter["revision"]) == (
        REPO,
        OLD,
    )  # recorded with the adapter
    # the offline merge takes the base at that revision (main's 2 layers would not fit the adapter)
    env = {**os.environ, "HF_HUB_CACHE": str(hub_cache), "HF_HUB_OFFLINE": "1"}
    merged = subprocess.run(
        [sys.executable, "-m", "ndparallel", "export", str(final), str(tmp_path / "merged"), "--merge"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert merged.returncode == 0, merged.stderr[-3000:]
    config = json.loads((tmp_path / "merged" / "config.json").read_text())
    assert config["num_hidden_layers"] == 1  # weights and config of the old commit
    missing = _run(hub_cache, tmp_path / "missing", f"revision_of_model: {'ef' * 20}\n", "--dry-run")
    assert missing.returncode == 2 and len(missing.stderr.strip().splitlines()) == 1, missing.stderr
    assert "base_model='tiny-org/tiny-llama'" in missing.stderr


def test_a_revision_of_a_local_model_is_refused(tmp_path, capsys, monkeypatch):
    forbid_launch(monkeypatch)
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"base_model: tiny-llama\nrevision_of_model: abc1234\noutput_dir: {tmp_path}/o\n")
    code, _, err = run_cli(capsys, "train", cfg, "--dry-run")
    assert code == 2 and "revision_of_model='abc1234' picks a revision of a Hub base_model" in err, err
