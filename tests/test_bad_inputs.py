"""The replayable list of bad inputs (issue #14): each gives one line on stderr naming the field or
flag and the fix, exit code 2, no traceback, in seconds, and nothing a user wrote is deleted or
overwritten.

Most cases call the CLI's ``main()`` in-process with the launcher replaced by a failing stub, so a
case that is not caught before launch fails at once instead of starting ranks. A few end-to-end
cases (errors found on the ranks, a real second run into a used ``output_dir``) start ranks.
``plan`` inputs are tested with the planner (issue #19).
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cli_helpers import forbid_launch, run_cli

ROOT = Path(__file__).resolve().parents[1]
SMALL_DATA = ["tokenizer_vocab_size=512", "sequence_len=32"]


# ----------------------------------------------------------------------------------- helpers
@pytest.fixture(autouse=True)
def _never_launch(monkeypatch):
    """A case must be refused before any rank starts."""
    forbid_launch(monkeypatch)


def _refused(result, *fragments):
    """Exit 2, exactly one line on stderr holding every fragment, no traceback."""
    code, _, err = result
    assert code == 2, err
    assert "Traceback" not in err, err
    assert len(err.strip().splitlines()) == 1, err
    for f in fragments:
        assert f in err, err
    return err


def _yaml(tmp_path: Path, text: str, name: str = "cfg.yaml") -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def _cfg(tmp_path: Path, extra: str = "", base_model: str = "tiny-llama") -> Path:
    """A good small config (``extra`` appended: later keys win) with its own output and cache dir."""
    return _yaml(
        tmp_path,
        f"base_model: {base_model}\ntokenizer_vocab_size: 512\nsequence_len: 32\n"
        f"output_dir: {tmp_path / 'out'}\ndataset_cache_dir: {tmp_path / 'cache'}\n" + extra,
    )


def _snapshot(root: Path) -> dict[str, str]:
    """Every file under ``root`` with its sha256: what must not change."""
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


# ------------------------------------------------------------------------ schema: ranges
@pytest.mark.parametrize(
    "field, value, fragment",
    [
        ("max_steps", 0, "'max_steps': must be >= 1"),
        ("max_steps", -5, "'max_steps': must be >= 1"),
        ("num_epochs", -1, "'num_epochs': must be > 0"),
        ("num_epochs", 0, "'num_epochs': must be > 0"),
        ("save_total_limit", 0, "'save_total_limit': must be >= 1"),
        ("save_total_limit", -1, "'save_total_limit': must be >= 1"),
        ("save_steps", -1, "'save_steps': must be >= 1"),
        ("save_steps", 0, "'save_steps': must be >= 1"),
        ("eval_steps", 0, "'eval_steps': must be >= 1"),
        ("logging_steps", 0, "'logging_steps': must be >= 1"),
        ("warmup_steps", -10, "'warmup_steps': must be >= 0"),
        ("collective_timeout_s", -1, "'collective_timeout_s': must be > 0"),
        ("collective_timeout_s", ".nan", "'collective_timeout_s'"),
        ("max_restarts", -1, "'max_restarts': must be >= 0"),
        ("learning_rate", -0.1, "'learning_rate': must be > 0"),
        ("learning_rate", ".inf", "'learning_rate'"),
        ("weight_decay", -1, "'weight_decay': must be >= 0"),
        ("adam_beta1", 1.5, "'adam_beta1': must be < 1"),
        ("adam_beta2", -0.1, "'adam_beta2': must be >= 0"),
        ("adam_epsilon", 0, "'adam_epsilon': must be > 0"),
        ("max_grad_norm", -1, "'max_grad_norm': must be > 0"),
        ("micro_batch_size", 0, "'micro_batch_size': must be >= 1"),
        ("gradient_accumulation_steps", -2, "'gradient_accumulation_steps': must be >= 1"),
        ("sequence_len", 0, "'sequence_len': must be >= 1"),
        ("val_set_size", -0.1, "'val_set_size': must be >= 0"),
        ("val_set_size", 2.5, "'val_set_size'"),
        ("seed", -1, "'seed': must be >= 0"),
        ("tokenizer_vocab_size", 100, "'tokenizer_vocab_size': must be >= 259"),
        ("datasets[0].max_bytes", 0, "'datasets.0.max_bytes': must be >= 1"),
    ],
)
def test_numeric_field_out_of_range(tmp_path, capsys, field, value, fragment):
    if field.startswith("datasets"):
        extra = f"datasets: [{{path: 'builtin:stdlib', max_bytes: {value}}}]\n"
    else:
        extra = f"{field}: {value}\n"
    err = _refused(run_cli(capsys, "train", _cfg(tmp_path, extra), "--dry-run"), fragment)
    assert "got" in err  # the value given is echoed


def test_range_message_names_the_fix(tmp_path, capsys):
    _refused(
        run_cli(capsys, "train", _cfg(tmp_path, "max_steps: 0\n"), "--dry-run"),
        "leave it out to train num_epochs epochs",
    )


def test_num_epochs_with_max_steps_is_said_to_be_ignored(tmp_path, capsys):
    code, out, err = run_cli(capsys, "train", _cfg(tmp_path, "num_epochs: 3\nmax_steps: 20\n"), "--dry-run")
    assert code == 0, err
    assert "max_steps 20 (num_epochs 3 is ignored: max_steps wins)" in out


def test_sequence_len_beyond_max_position_embeddings(tmp_path, capsys):
    """A learned position table (GPT-2's wpe) has no row past max_position_embeddings: refused.
    Rotary positions are computed: accepted with a note (Axolotl's ALST examples train 500k tokens)."""
    from axolotl_stand_ins import stand_in

    gpt2 = stand_in(tmp_path, "gpt2")  # n_positions 8192
    _refused(
        run_cli(capsys, "train", _cfg(tmp_path, "sequence_len: 8200\n", base_model=str(gpt2)), "--dry-run"),
        "sequence_len=8200",
        "max_position_embeddings=8192",
        "learned table (transformer.wpe)",
    )
    code, out, err = run_cli(capsys, "train", _cfg(tmp_path, "sequence_len: 8192\n"), "--dry-run")
    assert code == 0, err
    assert "sequence_len=8192 goes past the model's max_position_embeddings=4096" in out, out


# --------------------------------------------------------------------------- the CLI
def test_set_with_broken_yaml_value(tmp_path, capsys):
    _refused(
        run_cli(capsys, "train", _cfg(tmp_path), "--set", "max_steps=[1,", "--dry-run"),
        "--set 'max_steps=[1,'",
    )


def test_set_into_a_scalar(tmp_path, capsys):
    _refused(run_cli(capsys, "train", _cfg(tmp_path), "--set", "max_steps.x=1", "--dry-run"), "max_steps")


def test_bad_flag_value_is_one_line(capsys):
    _refused(run_cli(capsys, "verify", "--steps", "abc"), "--steps", "invalid int value")


def test_verify_steps_zero(capsys):
    _refused(run_cli(capsys, "verify", "--steps", "0"), "--steps", ">= 1")


def test_train_nproc_per_node_zero(tmp_path, capsys):
    _refused(run_cli(capsys, "train", _cfg(tmp_path), "--nproc-per-node", "0"), "--nproc-per-node", ">= 1")


@pytest.mark.parametrize("value", ["0", "-3", "many"])
def test_launch_nproc_per_node_invalid(capsys, value):
    _refused(run_cli(capsys, "launch", "--nproc-per-node", value, "script.py"), "--nproc-per-node")


def test_unknown_command_is_one_line(capsys):
    _refused(run_cli(capsys, "trian"), "unknown command 'trian'", "did you mean 'train'")


def test_missing_config_file(tmp_path, capsys):
    _refused(run_cli(capsys, "train", tmp_path / "nope.yaml"), "nope.yaml not found")


# ------------------------------------------------------------------------------- models
def test_preset_typo_suggests_the_preset(tmp_path, capsys):
    import time

    t0 = time.perf_counter()
    _refused(
        run_cli(capsys, "train", _cfg(tmp_path, base_model="tiny-lama"), "--dry-run"),
        "unknown preset",
        "did you mean 'tiny-llama'",
    )
    assert time.perf_counter() - t0 < 10  # no Hub round trip, no retries


@pytest.mark.parametrize("path", ["./no/such/model", "no/such/model", "/no/such/model", "~/no-such-model"])
def test_missing_local_model_path(tmp_path, capsys, path):
    err = _refused(run_cli(capsys, "train", _cfg(tmp_path, base_model=path), "--dry-run"), "does not exist")
    assert "Repo id" not in err


def test_hub_id_not_cached_offline_fails_fast(tmp_path, capsys):
    import time

    t0 = time.perf_counter()
    _refused(
        run_cli(capsys, "train", _cfg(tmp_path, base_model="someorg/somemodel"), "--dry-run"),
        "someorg/somemodel",
        "not in the local Hugging Face cache",
    )
    assert time.perf_counter() - t0 < 10


def _save_tiny_llama(directory: Path, **overrides) -> Path:
    import torch
    from transformers import AutoModelForCausalLM

    from ndparallel.models.presets import preset_config

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(preset_config("tiny-llama", **overrides))
    model.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    return _save_tiny_llama(tmp_path_factory.mktemp("models") / "tiny")


def _copy_model(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


def test_weights_with_wrong_shapes(tmp_path, capsys, tiny_model):
    model = _copy_model(tiny_model, tmp_path / "m")
    cfg = json.loads((model / "config.json").read_text())
    cfg["intermediate_size"] = 96  # the weights were saved with 128
    (model / "config.json").write_text(json.dumps(cfg))
    _refused(
        run_cli(capsys, "train", _cfg(tmp_path, base_model=str(model)), "--dry-run"),
        "shape",
        "mlp",
        "config.json",
    )


def test_weights_with_renamed_keys(tmp_path, capsys, tiny_model):
    from safetensors.torch import load_file, save_file

    model = _copy_model(tiny_model, tmp_path / "m")
    tensors = load_file(model / "model.safetensors")
    tensors = {k.replace("self_attn.q_proj", "attention.wq"): v for k, v in tensors.items()}
    save_file(tensors, model / "model.safetensors", metadata={"format": "pt"})
    _refused(
        run_cli(capsys, "train", _cfg(tmp_path, base_model=str(model)), "--dry-run"),
        "not in the checkpoint",
        "q_proj",
    )


def test_truncated_safetensors(tmp_path, capsys, tiny_model):
    model = _copy_model(tiny_model, tmp_path / "m")
    f = model / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) - 1000])
    _refused(
        run_cli(capsys, "train", _cfg(tmp_path, base_model=str(model)), "--dry-run"),
        "model.safetensors",
        "truncated",
    )


def test_safetensors_with_garbage_header(tmp_path, capsys, tiny_model):
    model = _copy_model(tiny_model, tmp_path / "m")
    (model / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!")
    _refused(
        run_cli(capsys, "train", _cfg(tmp_path, base_model=str(model)), "--dry-run"),
        "model.safetensors",
        "not a safetensors file",
    )


def _save_bert(directory: Path, is_decoder: bool) -> Path:
    from transformers import BertConfig, BertLMHeadModel

    config = BertConfig(
        vocab_size=256,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        is_decoder=is_decoder,
    )
    BertLMHeadModel(config).save_pretrained(directory)
    return directory


def test_bidirectional_model_is_refused(tmp_path, capsys):
    model = _save_bert(tmp_path / "bert", is_decoder=False)
    _refused(
        run_cli(capsys, "train", _cfg(tmp_path, base_model=str(model)), "--dry-run"),
        "not a causal decoder",
        "BertLMHeadModel",
        "is_decoder",
    )


def test_causal_check_rule():
    """Refused: bidirectional self-attention (BERT without is_decoder), encoder-decoders; accepted:
    causal decoders, BERT with is_decoder=True (its self-attention is then causal)."""
    import torch
    from transformers import AutoModelForCausalLM, BertConfig, BertLMHeadModel, T5Config

    from ndparallel.models.causal import causal_lm_problem
    from ndparallel.models.presets import preset_config

    with torch.device("meta"):
        assert causal_lm_problem(AutoModelForCausalLM.from_config(preset_config("tiny-llama"))) is None
        small = dict(
            vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128
        )
        assert causal_lm_problem(BertLMHeadModel(BertConfig(**small, is_decoder=True))) is None
        assert "bidirectional" in causal_lm_problem(BertLMHeadModel(BertConfig(**small)))
    from ndparallel.models.causal import config_problem

    assert "encoder-decoder" in config_problem(T5Config(num_layers=2, d_model=64))


def test_non_causal_model_refused_when_loaded_on_the_ranks():
    """The same rule inside ``load_model`` (a config given through the API, no preflight)."""
    from transformers import BertConfig

    from ndparallel.engine.model_build import build_model

    cfg = BertConfig(
        vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128
    )
    with pytest.raises(ValueError, match="not a causal decoder"):
        build_model(None, cfg)


def test_encoder_decoder_is_refused(tmp_path, capsys):
    from transformers import T5Config

    T5Config(num_layers=2, d_model=64, d_ff=128, num_heads=4, vocab_size=256).save_pretrained(tmp_path / "t5")
    _refused(run_cli(capsys, "train", _cfg(tmp_path, base_model=str(tmp_path / "t5")), "--dry-run"), "causal")


def test_cuda_without_gpu(tmp_path, capsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    _refused(run_cli(capsys, "train", _cfg(tmp_path, "device: cuda\n")), "device", "cuda", "no CUDA GPU")


# ---------------------------------------------------------------------------------- data
def _data_cfg(tmp_path: Path, data: Path, extra: str = "") -> Path:
    return _cfg(tmp_path, f"datasets: [{{path: '{data}'{extra}}}]\n")


def test_empty_jsonl(tmp_path, capsys):
    data = tmp_path / "d.jsonl"
    data.write_text("")
    _refused(run_cli(capsys, "train", _data_cfg(tmp_path, data)), "datasets[0]", "d.jsonl", "empty")


def test_blank_lines_only_jsonl(tmp_path, capsys):
    data = tmp_path / "d.jsonl"
    data.write_text("\n\n  \n")
    _refused(run_cli(capsys, "train", _data_cfg(tmp_path, data)), "datasets[0]", "no records")


def test_jsonl_line_that_is_not_json(tmp_path, capsys):
    data = tmp_path / "d.jsonl"
    data.write_text('{"text": "a"}\n{"text": "b"}\n{"text": oops}\n')
    _refused(run_cli(capsys, "train", _data_cfg(tmp_path, data)), "d.jsonl line 3", "not valid JSON")


def test_jsonl_line_that_is_not_an_object(tmp_path, capsys):
    data = tmp_path / "d.jsonl"
    data.write_text('{"text": "a"}\n[1, 2]\n')
    _refused(run_cli(capsys, "train", _data_cfg(tmp_path, data)), "d.jsonl line 2", "object")


@pytest.mark.parametrize("name", ["d.jsonl", "d.txt", "d.csv", "d.json"])
def test_binary_file_with_a_text_extension(tmp_path, capsys, name):
    data = tmp_path / name
    data.write_bytes(bytes(range(256)) * 40)
    _refused(run_cli(capsys, "train", _data_cfg(tmp_path, data)), name, "binary")


def test_jsonl_missing_text_column(tmp_path, capsys):
    data = tmp_path / "d.jsonl"
    data.write_text('{"content": "a"}\n{"content": "b"}\n')
    _refused(run_cli(capsys, "train", _data_cfg(tmp_path, data)), "text_field", "'text'", "content")


def test_csv_missing_text_column(tmp_path, capsys):
    data = tmp_path / "d.csv"
    data.write_text("content,label\nhello,1\n")
    _refused(run_cli(capsys, "train", _data_cfg(tmp_path, data)), "text_field", "content")


def test_json_array_document_missing_column(tmp_path, capsys):
    data = tmp_path / "d.json"
    data.write_text(json.dumps([{"body": "a"}, {"body": "b"}]))
    _refused(run_cli(capsys, "train", _data_cfg(tmp_path, data)), "text_field", "body")


def test_not_a_parquet_file(tmp_path, capsys):
    data = tmp_path / "d.parquet"
    data.write_text("hello")
    _refused(run_cli(capsys, "train", _data_cfg(tmp_path, data)), "d.parquet", "not a parquet file")


def test_text_field_on_a_plain_text_file(tmp_path, capsys):
    data = tmp_path / "d.txt"
    data.write_text("hello world\n")
    _refused(
        run_cli(capsys, "train", _data_cfg(tmp_path, data, ", text_field: body")), "text_field", "'text'"
    )


def test_directory_with_one_bad_file(tmp_path, capsys):
    d = tmp_path / "data"
    d.mkdir()
    (d / "a.jsonl").write_text('{"text": "a"}\n')
    (d / "b.jsonl").write_text("")
    _refused(run_cli(capsys, "train", _data_cfg(tmp_path, d)), "b.jsonl", "empty")


def test_good_data_passes_the_checks(tmp_path):
    from ndparallel.data.check import check_dataset

    data = tmp_path / "d.jsonl"
    data.write_text('{"text": "a"}\n\n{"text": "b", "x": 1}\n')
    check_dataset({"path": str(data)}, "datasets[0]")
    (tmp_path / "d.csv").write_text("text,label\nhello,1\n")
    check_dataset({"path": str(tmp_path / "d.csv")}, "datasets[0]")
    (tmp_path / "d.json").write_text(json.dumps([{"text": "a"}]))
    check_dataset({"path": str(tmp_path / "d.json")}, "datasets[0]")
    (tmp_path / "d.txt").write_text("héllo wörld\n")
    check_dataset({"path": str(tmp_path / "d.txt")}, "datasets[0]")


def test_missing_tokenizer_dir(tmp_path, capsys):
    _refused(
        run_cli(capsys, "train", _cfg(tmp_path, f"tokenizer: {tmp_path / 'no-tok'}\n")),
        "tokenizer",
        "does not exist",
    )


def test_explicit_resume_path_that_is_not_a_checkpoint(tmp_path, capsys):
    (tmp_path / "ckpt").mkdir()
    _refused(
        run_cli(capsys, "train", _cfg(tmp_path, f"resume_from_checkpoint: {tmp_path / 'ckpt'}\n")),
        "resume_from_checkpoint",
        "not a usable checkpoint",
    )


# ---------------------------------------------------------------------------- output_dir
def test_output_dir_that_is_a_file(tmp_path, capsys):
    (tmp_path / "out").write_text("mine")
    _refused(run_cli(capsys, "train", _cfg(tmp_path)), "output_dir", "is a file")
    assert (tmp_path / "out").read_text() == "mine"


def test_output_dir_under_a_file(tmp_path, capsys):
    (tmp_path / "f").write_text("mine")
    cfg = _cfg(tmp_path, f"output_dir: {tmp_path / 'f' / 'run'}\n")
    _refused(run_cli(capsys, "train", cfg), "output_dir", "is a file")


def _fake_previous_run(out: Path) -> None:
    """What a finished run leaves (written by the real trainer in the end-to-end test below)."""
    from ndparallel.checkpoint.ownership import claim, start_run

    start_run(out)
    for name in ("checkpoint-2", "final", "metrics.jsonl", "config.resolved.yaml"):
        claim(out, name)
    (out / "checkpoint-2").mkdir()
    (out / "checkpoint-2" / "COMPLETE").write_text("{}")
    (out / "final").mkdir()
    (out / "final" / "model.safetensors").write_bytes(b"weights")
    (out / "metrics.jsonl").write_text('{"step": 1, "loss": 5.0}\n')
    (out / "config.resolved.yaml").write_text("seed: 1\n")


def test_new_run_into_a_previous_run_is_refused(tmp_path, capsys):
    out = tmp_path / "out"
    _fake_previous_run(out)
    before = _snapshot(out)
    _refused(
        run_cli(capsys, "train", _cfg(tmp_path, "seed: 7\n")),
        "output_dir",
        "another run",
        "resume_from_checkpoint: auto",
        "overwrite_output_dir: true",
    )
    assert _snapshot(out) == before


@pytest.mark.parametrize("own", ["metrics.png", "final/model.safetensors", "metrics.jsonl", "checkpoint-3/x"])
def test_users_own_files_are_never_overwritten(tmp_path, capsys, own):
    out = tmp_path / "out"
    (out / own).parent.mkdir(parents=True, exist_ok=True)
    (out / own).write_bytes(b"the user's own")
    before = _snapshot(out)
    _refused(run_cli(capsys, "train", _cfg(tmp_path)), "output_dir", own.split("/")[0])
    # overwrite_output_dir replaces a previous run's files, never files no run wrote
    _refused(run_cli(capsys, "train", _cfg(tmp_path, "overwrite_output_dir: true\n")), own.split("/")[0])
    assert _snapshot(out) == before


def test_unrelated_files_block_a_new_run_unless_overwrite(tmp_path, capsys, monkeypatch):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    _refused(run_cli(capsys, "train", _cfg(tmp_path)), "output_dir", "notes.txt", "overwrite_output_dir")
    from ndparallel.axolotl import load_config
    from ndparallel.training.outputs import plan_output_dir

    cfg = load_config(_cfg(tmp_path, "overwrite_output_dir: true\n"))
    assert plan_output_dir(cfg, resuming=False).conflicts == []  # allowed: notes.txt is left alone


def test_a_dataset_cache_inside_output_dir_is_not_a_foreign_file(tmp_path):
    from ndparallel.axolotl import load_config
    from ndparallel.training.outputs import plan_output_dir

    (tmp_path / "out" / "cache").mkdir(parents=True)
    cfg = load_config(_cfg(tmp_path, f"dataset_cache_dir: {tmp_path / 'out' / 'cache'}\n"))
    assert plan_output_dir(cfg, resuming=False).conflicts == []


def test_resume_into_a_previous_run_is_allowed(tmp_path):
    from ndparallel.axolotl import load_config
    from ndparallel.training.outputs import plan_output_dir

    out = tmp_path / "out"
    _fake_previous_run(out)
    cfg = load_config(_cfg(tmp_path, "resume_from_checkpoint: auto\n"))
    assert plan_output_dir(cfg, resuming=True).conflicts == []


def test_rotation_never_deletes_a_checkpoint_the_run_did_not_write(tmp_path):
    from ndparallel.checkpoint.directory import rotate_checkpoints
    from ndparallel.checkpoint.ownership import claim, start_run

    out = tmp_path / "out"
    start_run(out)
    for step in (1, 2, 3):
        d = out / f"checkpoint-{step}"
        d.mkdir()
        _complete(d, step)
        if step != 1:
            claim(out, d.name)
    deleted = rotate_checkpoints(out, 1)
    assert [p.name for p in deleted] == ["checkpoint-2"]
    assert (out / "checkpoint-1").is_dir() and (out / "checkpoint-3").is_dir()


def _complete(d: Path, step: int) -> None:
    from ndparallel.checkpoint.directory import STATE_FILE, write_marker

    (d / ".metadata").write_bytes(b"x")
    (d / STATE_FILE).write_text("{}")
    write_marker(d, {"step": step, "world_size": 1, "layout": None})


# -------------------------------------------------------------------------------- export
def _fake_checkpoint(tmp_path: Path) -> Path:
    """A real tiny checkpoint (1 process) of tiny-llama, saved with the checkpoint API."""
    from ndparallel.testing import run_on_ranks

    ckpt = tmp_path / "ckpt"
    run_on_ranks(_save_ckpt, 1, str(ckpt))
    return ckpt


def _save_ckpt(path: str):
    import torch

    from ndparallel import Accelerator
    from ndparallel.checkpoint import save_checkpoint

    acc = Accelerator()
    model = acc.load_model("tiny-llama")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    save_checkpoint(path, model, opt, step=1)
    return True


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return _fake_checkpoint(tmp_path_factory.mktemp("ckpt"))


def test_export_into_a_non_empty_dir_is_refused(tmp_path, capsys, checkpoint):
    target = tmp_path / "other-model"
    target.mkdir()
    (target / "model.safetensors").write_bytes(b"another model")
    (target / "config.json").write_text("{}")
    before = _snapshot(target)
    _refused(run_cli(capsys, "export", checkpoint, target), "not empty", "--overwrite")
    assert _snapshot(target) == before


def test_export_overwrite_replaces(tmp_path, capsys, checkpoint):
    target = tmp_path / "out"
    target.mkdir()
    (target / "model.safetensors").write_bytes(b"old")
    code, _, err = run_cli(capsys, "export", checkpoint, target, "--overwrite")
    assert code == 0, err
    assert (target / "model.safetensors").stat().st_size > 1000


def test_export_with_a_mismatched_model_config(tmp_path, capsys, checkpoint, tiny_model):
    other = _copy_model(tiny_model, tmp_path / "m")
    cfg = json.loads((other / "config.json").read_text())
    cfg["intermediate_size"] = 96
    (other / "config.json").write_text(json.dumps(cfg))
    _refused(
        run_cli(capsys, "export", checkpoint, tmp_path / "out", "--config", other), "does not match", "shape"
    )
    assert not (tmp_path / "out").exists()


def test_export_of_a_missing_checkpoint(tmp_path, capsys):
    _refused(run_cli(capsys, "export", tmp_path / "nope", tmp_path / "out"), "nope")


def test_plot_never_overwrites_a_users_png(tmp_path, capsys):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 5.0}\n{"step": 2, "loss": 4.0}\n')
    (tmp_path / "metrics.png").write_bytes(b"mine")
    _refused(run_cli(capsys, "plot", tmp_path), "metrics.png", "--out")
    assert (tmp_path / "metrics.png").read_bytes() == b"mine"


# ------------------------------------------------------------------- errors on the ranks
def _train_in_process(cfg_path: str):
    from ndparallel.axolotl import load_config
    from ndparallel.training.trainer import run_training

    run_training(load_config(cfg_path))
    return True


def test_rank_zero_refuses_to_overwrite_what_it_did_not_write(tmp_path):
    """Even past the pre-launch check (e.g. files dropped in after it), the trainer refuses on the
    ranks before writing anything."""
    from ndparallel.testing import RankFailure, run_on_ranks

    out = tmp_path / "out"
    out.mkdir()
    (out / "metrics.png").write_bytes(b"mine")
    cfg = _cfg(tmp_path, "max_steps: 1\ndatasets: [{path: 'builtin:stdlib', max_bytes: 50000}]\n")
    with pytest.raises(RankFailure, match="metrics.png"):
        run_on_ranks(_train_in_process, 1, str(cfg))
    assert (out / "metrics.png").read_bytes() == b"mine"
    assert sorted(p.name for p in out.iterdir()) == ["metrics.png"]


def _cli(*args, timeout=300, cwd=ROOT):
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"}
    return subprocess.run(
        [sys.executable, "-m", "ndparallel", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
        env=env,
    )


def _error_lines(stderr: str) -> list[str]:
    return [
        ln
        for ln in stderr.splitlines()
        if "error" in ln.lower() or "failed" in ln.lower() or "stalled" in ln or "Traceback" in ln
    ]


def test_error_found_on_the_ranks_is_one_line_exit_2(tmp_path):
    """Found only on the ranks (the launcher checks a resume checkpoint's files and sizes, the ranks
    re-hash them: a corrupted file of the right size): the first failing rank's message, once,
    exit 2, no 'job failed' / 'stalled' lines. (Data problems themselves, e.g. a dataset smaller
    than one block, are found before launch: next test.)"""
    from ndparallel.checkpoint.directory import FORMAT, MARKER, STATE_FILE

    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    for name in (".metadata", STATE_FILE):
        (ckpt / name).write_bytes(b"x" * 8)
    files = {n: {"size": 8, "sha256": "0" * 64} for n in (".metadata", STATE_FILE)}
    (ckpt / MARKER).write_text(json.dumps({"format": FORMAT, "files": files}))
    cfg = _cfg(
        tmp_path,
        "datasets: [{path: 'builtin:stdlib', max_bytes: 50000}]\n"
        f"max_steps: 1\ndp_shard_size: 2\nresume_from_checkpoint: {ckpt}\n",
    )
    proc = _cli("train", cfg)
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = _error_lines(proc.stderr)
    assert len(lines) == 1 and lines[0].startswith("ndparallel train: error:"), proc.stderr[-3000:]
    assert "resume_from_checkpoint" in lines[0] and "corrupted" in lines[0], lines


def test_dataset_smaller_than_one_block_is_found_before_launch(tmp_path, capsys):
    data = tmp_path / "tiny.jsonl"
    data.write_text(json.dumps({"text": "hello world"}) + "\n")
    cfg = _cfg(tmp_path, f"datasets: [{{path: '{data}'}}]\nsequence_len: 512\ndp_shard_size: 2\n")
    _refused(run_cli(capsys, "train", cfg), "block")


def test_second_run_into_the_same_output_dir_end_to_end(tmp_path, capsys, monkeypatch):
    """A real run, then a new run (other seed, no resume) into its output_dir: refused before
    launch, the first run's files byte for byte intact; ``overwrite_output_dir: true`` then
    replaces the first run's files and leaves the user's own file alone."""
    from ndparallel.testing import run_on_ranks

    extra = (
        "max_steps: 2\nsave_steps: 1\nsave_total_limit: 1\n"
        "datasets: [{path: 'builtin:stdlib', max_bytes: 50000}]\n"
    )
    first = _cfg(tmp_path, extra)
    run_on_ranks(_train_in_process, 1, str(first))
    out = tmp_path / "out"
    assert (out / "final" / "model.safetensors").is_file() and (out / "checkpoint-2").is_dir()
    (out / "notes.txt").write_text("mine")
    before = _snapshot(out)
    second = _yaml(tmp_path, first.read_text() + "seed: 7\n", "second.yaml")
    with monkeypatch.context() as launches:
        forbid_launch(launches)  # refused before launch: `ndparallel train` in this process
        _refused(run_cli(capsys, "train", second), "another run")
    assert _snapshot(out) == before
    third = _yaml(tmp_path, second.read_text() + "overwrite_output_dir: true\n", "third.yaml")
    run_on_ranks(_train_in_process, 1, str(third))
    assert (out / "notes.txt").read_text() == "mine"
    assert _snapshot(out)["final/model.safetensors"] != before["final/model.safetensors"]
