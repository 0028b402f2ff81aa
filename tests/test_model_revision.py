"""``revision_of_model`` (Axolotl's; alias ``model_revision``): a Hub base_model's config, weights and
tokenizer all come from that revision. Proven offline on a Hugging Face cache holding two revisions
of one repository (main: 2 layers, an older commit: 1 layer)."""

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


@pytest.fixture
def offline_hub(hub_cache, monkeypatch):
    """This process's Hub client reading ``hub_cache``, offline: what ``HF_HUB_CACHE`` and
    ``HF_HUB_OFFLINE`` give a fresh interpreter (huggingface_hub reads them once, at import)."""
    import huggingface_hub.constants as hub

    monkeypatch.setattr(hub, "HF_HUB_CACHE", str(hub_cache))
    monkeypatch.setattr(hub, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_CACHE", str(hub_cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("NDPARALLEL_DEVICE", "cpu")
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    return hub_cache


def _run(capsys, tmp_path: Path, extra: str, *args: str) -> tuple[int, str, str]:
    """``ndparallel train`` in this process (one rank: the command runs it here, as a launched one
    would, with no agent: ``runtime/launch.py: run_here``)."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    data = write_jsonl(tmp_path / "a.jsonl", alpaca_records(16))
    cfg = tmp_path / "c.yaml"
    cfg.write_text(
        f"base_model: {REPO}\nsequence_len: 256\nmicro_batch_size: 2\nmax_steps: 1\n"
        f"output_dir: {tmp_path / 'out'}\ndatasets: [{{path: {data}, type: alpaca}}]\n" + extra
    )
    return run_cli(capsys, "train", cfg, *args)


def test_the_pinned_revision_is_what_trains(offline_hub, tmp_path, capsys):
    code, out, err = _run(capsys, tmp_path / "main", "", "--dry-run")
    assert code == 0, err
    assert f"model        : {REPO} (llama, 2 layers" in out
    code, _, err = _run(
        capsys,
        tmp_path / "train",
        f"model_revision: {OLD}\nadapter: lora\nlora_r: 2\nlora_target_linear: true\n",
    )  # Axolotl's other name; a LoRA run on the old commit
    assert code == 0, err[-3000:]
    import json

    final = tmp_path / "train" / "out" / "final"
    adapter = json.loads((final / "adapter_config.json").read_text())
    assert (adapter["base_model_name_or_path"], adapter["revision"]) == (
        REPO,
        OLD,
    )  # recorded with the adapter
    # the offline merge takes the base at that revision (main's 2 layers would not fit the adapter)
    code, _, err = run_cli(capsys, "export", final, tmp_path / "merged", "--merge")
    assert code == 0, err[-3000:]
    config = json.loads((tmp_path / "merged" / "config.json").read_text())
    assert config["num_hidden_layers"] == 1  # weights and config of the old commit
    code, _, err = _run(capsys, tmp_path / "missing", f"revision_of_model: {'ef' * 20}\n", "--dry-run")
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "base_model='tiny-org/tiny-llama'" in err


def test_a_revision_of_a_local_model_is_refused(tmp_path, capsys, monkeypatch):
    forbid_launch(monkeypatch)
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"base_model: tiny-llama\nrevision_of_model: abc1234\noutput_dir: {tmp_path}/o\n")
    code, _, err = run_cli(capsys, "train", cfg, "--dry-run")
    assert code == 2 and "revision_of_model='abc1234' picks a revision of a Hub base_model" in err, err
