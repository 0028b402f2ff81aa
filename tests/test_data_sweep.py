"""Inputs that used to be accepted and then mean something other than what their writer meant
(issue #37, item 3): each is refused (exit 2, one line naming the field and the fix, before
launch) or noted in one line. docs/data.md lists them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cli_helpers import forbid_launch, run_cli


@pytest.fixture(autouse=True)
def _never_launch(monkeypatch):
    forbid_launch(monkeypatch)


def refused(result, *fragments) -> str:
    code, _, err = result
    assert code == 2, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    for f in fragments:
        assert f in err, err
    return err


def config(tmp_path: Path, datasets: str, extra: str = "", name: str = "cfg.yaml", out: str = "out") -> Path:
    p = tmp_path / name
    p.write_text(
        f"base_model: tiny-llama\ntokenizer_vocab_size: 512\nsequence_len: 256\nmax_steps: 1\n"
        f"output_dir: {tmp_path / out}\ndataset_cache_dir: {tmp_path / 'cache'}\n"
        f"datasets: [{datasets}]\n{extra}"
    )
    return p


def write(path: Path, records: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def chats(tmp_path: Path, roles=("user", "assistant"), **extra) -> Path:
    return write(
        tmp_path / "c.jsonl",
        [{"messages": [{"role": r, "content": f"{r} says {i}", **extra} for r in roles]} for i in range(8)],
    )


def texts(tmp_path: Path) -> Path:
    return write(tmp_path / "d.jsonl", [{"text": f"def f{i}(x): return x * {i}"} for i in range(40)])


CHAT = "type: chat_template, chat_template: chatml"


# ---------------------------------------------------- field names: case and dash variants
@pytest.mark.parametrize(
    "extra, datasets_key, fragment",
    [
        ("micro-batch-size: 2\n", "", "did you mean 'micro_batch_size'"),
        ("Sequence_Len: 64\n", "", "did you mean 'sequence_len'"),
        ("", ", Type: completion", "did you mean 'type'"),
        ("", ", text-field: text", "text_field"),
    ],
)
def test_case_and_dash_variants_of_field_names_are_refused(tmp_path, capsys, extra, datasets_key, fragment):
    data = texts(tmp_path)
    refused(run_cli(capsys, "train", config(tmp_path, f"{{path: '{data}'{datasets_key}}}", extra)), fragment)


# ---------------------------------------------------------------------------- split
def test_a_split_a_local_file_does_not_have_is_refused(tmp_path, capsys):
    data = texts(tmp_path)
    refused(
        run_cli(capsys, "train", config(tmp_path, f"{{path: '{data}', type: completion, split: test}}")),
        "datasets[0].split",
        "'test'",
        "one split, train",
        "val_set_size",
    )


def test_a_slice_of_the_train_split_is_accepted(tmp_path):
    from ndparallel.data.dataset import load_text_dataset

    assert len(load_text_dataset({"path": str(texts(tmp_path)), "split": "train[:25%]"})) == 10


# -------------------------------------------------------------- field / field_* names
@pytest.mark.parametrize(
    "setting, fragment",
    [
        ("type: completion, field: body", "column 'body'"),
        (f"{CHAT}, field_messages: conversations", "column 'conversations'"),
        (f"{CHAT}, field_thinking: reasoning", "field_thinking: no message"),
        (f"{CHAT}, message_property_mappings: {{role: from, content: value}}", "needs a text 'from'"),
    ],
)
def test_field_names_absent_from_the_records_are_refused(tmp_path, capsys, setting, fragment):
    data = texts(tmp_path) if "completion" in setting else chats(tmp_path)
    refused(
        run_cli(capsys, "train", config(tmp_path, f"{{path: '{data}', {setting}}}")), "datasets[0]", fragment
    )


def test_custom_format_field_absent_from_the_records_is_refused(tmp_path, capsys):
    data = write(tmp_path / "q.jsonl", [{"question": "q", "answer": "a"}] * 4)
    fmt = "{format: 'Q: {instruction} A: ', field_instruction: prompt, field_output: answer}"
    refused(run_cli(capsys, "train", config(tmp_path, f"{{path: '{data}', type: {fmt}}}")), "'prompt'")


def test_field_thinking_present_is_accepted(tmp_path):
    from ndparallel.data.chat_check import chat_problem
    from ndparallel.data.dataset import DatasetSpec, load_records

    spec = DatasetSpec.from_any(
        {
            "path": str(chats(tmp_path, reasoning="because")),
            "type": "chat_template",
            "field_thinking": "reasoning",
        }
    )
    assert chat_problem(load_records(spec), spec, {}, "datasets[0]") is None


# ------------------------------------------------------------- chat_template roles
def test_roles_to_train_the_data_never_uses_is_refused(tmp_path, capsys):
    data = chats(tmp_path, roles=("user", "helper"))  # no assistant turn: nothing would be trained
    refused(
        run_cli(capsys, "train", config(tmp_path, f"{{path: '{data}', {CHAT}}}")),
        "datasets[0].roles_to_train",
        "['assistant']",
        "'helper'",
        "roles: {assistant: [...]}",
    )


def test_roles_mapping_names_the_data_never_uses_is_refused(tmp_path, capsys):
    data = chats(tmp_path)
    refused(
        run_cli(
            capsys, "train", config(tmp_path, f"{{path: '{data}', {CHAT}, roles: {{assistant: [bot2]}}}}")
        ),
        "datasets[0].roles",
        "'bot2'",
    )


def test_sharegpt_role_names_count_as_their_template_roles(tmp_path):
    from ndparallel.data.chat import ROLE_NAMES
    from ndparallel.data.chat_check import chat_problem
    from ndparallel.data.dataset import DatasetSpec, load_records

    data = write(
        tmp_path / "s.jsonl",
        [{"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]}],
    )
    spec = DatasetSpec.from_any({"path": str(data), "type": "chat_template"})
    assert chat_problem(load_records(spec), spec, dict(ROLE_NAMES), "datasets[0]") is None


# ------------------------------------------------------ train_on_inputs without a prompt
def test_train_on_inputs_with_raw_text_or_segments_is_noted(tmp_path, capsys):
    data = texts(tmp_path)
    seg = write(
        tmp_path / "s.jsonl", [{"segments": [{"text": "a ", "label": False}, {"text": "b", "label": True}]}]
    )
    cfg = config(
        tmp_path,
        f"{{path: '{data}', type: completion}}, {{path: '{seg}', type: input_output}}",
        "train_on_inputs: true\n",
    )
    code, out, err = run_cli(capsys, "train", cfg, "--dry-run")
    assert code == 0, err
    notes = [line for line in out.splitlines() if "train_on_inputs: true" in line]
    assert len(notes) == 2 and "changes nothing for datasets[0]" in notes[0] and "datasets[1]" in notes[1], (
        out
    )


# -------------------------------------------------------------------- val_set_size
@pytest.mark.parametrize("size", ["5000", "0.999"])
def test_val_set_size_larger_than_the_data_is_refused(tmp_path, capsys, size):
    data = write(tmp_path / "a.jsonl", [{"instruction": f"add {i}", "output": str(i)} for i in range(20)])
    refused(
        run_cli(
            capsys, "train", config(tmp_path, f"{{path: '{data}', type: alpaca}}", f"val_set_size: {size}\n")
        ),
        "val_set_size",
        "leaving none to train on",
    )


# ------------------------------------------- dataset_prepared_path: another config's cache
def _samples(capsys, cfg: Path) -> list[dict]:
    code, out, err = run_cli(capsys, "preprocess", cfg, "--json")
    assert code == 0, err
    return [json.loads(line) for line in out.splitlines()]


def test_a_cache_shared_with_another_config_is_never_reused_for_it(tmp_path, capsys):
    data = write(tmp_path / "a.jsonl", [{"instruction": f"add {i}", "output": str(i)} for i in range(6)])
    masked = _samples(capsys, config(tmp_path, f"{{path: '{data}', type: alpaca}}", name="a.yaml"))
    trained = _samples(
        capsys,
        config(tmp_path, f"{{path: '{data}', type: alpaca}}", "train_on_inputs: true\n", name="b.yaml"),
    )
    assert all(-100 in s["labels"] for s in masked) and not any(-100 in s["labels"] for s in trained)
    write(data, [{"instruction": f"multiply {i} by many", "output": str(i)} for i in range(6)])  # same path
    again = _samples(capsys, config(tmp_path, f"{{path: '{data}', type: alpaca}}", name="a.yaml"))
    assert [s["input_ids"] for s in again] != [s["input_ids"] for s in masked]


def test_a_prepared_path_holding_axolotls_prepared_data_is_noted(tmp_path, capsys):
    prepared = tmp_path / "cache" / "0123abcd"
    prepared.mkdir(parents=True)
    (prepared / "dataset_info.json").write_text("{}")
    code, out, err = run_cli(capsys, "train", config(tmp_path, f"{{path: '{texts(tmp_path)}'}}"), "--dry-run")
    assert code == 0, err
    assert "holds Axolotl's prepared datasets (0123abcd)" in out and "does not read them" in out, out
