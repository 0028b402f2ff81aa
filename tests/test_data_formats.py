"""Data is read as its writer meant it, or refused before launch (issue #37): the file format a
``type`` names never contradicts the extension, and a bad line anywhere in a file (not only in
the head the quick look reads) is named with its file, line and column, exit 2, nothing written
to ``output_dir``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cli_helpers import forbid_launch, run_cli


@pytest.fixture(autouse=True)
def _never_launch(monkeypatch):
    forbid_launch(monkeypatch)


def refused(result, *fragments) -> str:
    """Exit 2, one line on stderr holding every fragment, no traceback."""
    code, _, err = result
    assert code == 2, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    for f in fragments:
        assert f in err, err
    return err


def config(tmp_path: Path, datasets: str, extra: str = "") -> Path:
    p = tmp_path / "cfg.yaml"
    p.write_text(
        f"base_model: tiny-llama\ntokenizer_vocab_size: 512\nsequence_len: 64\nmax_steps: 1\n"
        f"output_dir: {tmp_path / 'out'}\ndataset_cache_dir: {tmp_path / 'cache'}\n"
        f"datasets: [{datasets}]\n{extra}"
    )
    return p


def jsonl(path: Path, n: int = 40, bad: dict[int, str] | None = None) -> Path:
    lines = [json.dumps({"text": f"def f{i}(x): return x + {i}"}) for i in range(n)]
    for k, v in (bad or {}).items():
        lines[k] = v
    path.write_text("\n".join(lines) + "\n")
    return path


# ------------------------------------------------------------ item 1: format vs extension
@pytest.mark.parametrize("name", ["d.jsonl", "d.json", "d.csv", "d.parquet", "d.arrow"])
def test_plain_text_type_over_a_records_file_is_refused(tmp_path, capsys, name):
    data = tmp_path / name
    data.write_text('{"text": "a"}\n')
    err = refused(
        run_cli(capsys, "train", config(tmp_path, f"{{path: '{data}', type: text}}")),
        "datasets[0].type",
        name,
        "type: completion",
        "ds_type: text",
    )
    assert not (tmp_path / "out").exists(), err


@pytest.mark.parametrize("fmt", ["json", "csv", "parquet"])
def test_records_type_over_a_txt_file_is_refused(tmp_path, capsys, fmt):
    data = tmp_path / "d.txt"
    data.write_text("hello world\n")
    refused(
        run_cli(capsys, "train", config(tmp_path, f"{{path: '{data}', type: {fmt}}}")),
        "datasets[0].type",
        "d.txt",
        "plain text",
        "type: completion",
        f"ds_type: {fmt}",
    )


def test_type_and_ds_type_naming_two_formats_is_refused(tmp_path, capsys):
    data = jsonl(tmp_path / "d.jsonl")
    refused(
        run_cli(capsys, "train", config(tmp_path, f"{{path: '{data}', type: text, ds_type: json}}")),
        "type 'text' and ds_type 'json'",
        "keep one",
    )


def test_plain_text_type_over_a_directory_of_jsonl_is_refused(tmp_path, capsys):
    d = tmp_path / "data"
    d.mkdir()
    jsonl(d / "a.jsonl")
    refused(
        run_cli(capsys, "train", config(tmp_path, f"{{path: '{d}', type: text}}")),
        "a.jsonl",
        "type: completion",
    )


def test_agreeing_spellings_are_accepted(tmp_path):
    """``type: completion``, ``type: json`` on .jsonl, and the explicit ``ds_type: text`` (the JSON
    syntax really is the text) all read as written."""
    from ndparallel.data.dataset import load_text_dataset

    data = jsonl(tmp_path / "d.jsonl", n=3)
    for spec in ({"type": "completion"}, {"type": "json"}, {}):
        assert load_text_dataset({"path": str(data), **spec})["text"][0] == "def f0(x): return x + 0"
    raw = load_text_dataset({"path": str(data), "ds_type": "text", "sample_by": "line"})["text"]
    assert raw[0] == '{"text": "def f0(x): return x + 0"}'


# --------------------------------------------- item 2: every line parsed, the bad one named
BIG = 12_000  # > 1 MiB: the bad line lies beyond the head the quick look reads


@pytest.mark.parametrize(
    "line, fragments",
    [
        ('{"text": oops}', ["not valid JSON", "column 10"]),
        ("[1, 2]", ["a JSON array, not an object"]),
        ('{"body": "q"}', ["has no 'text'", "body"]),
        ('{"text": 5}', ["'text' is a JSON number, not text"]),
        ('{"text": null}', ["has no 'text'"]),
    ],
)
def test_a_bad_line_past_the_head_is_named(tmp_path, capsys, line, fragments):
    data = jsonl(tmp_path / "d.jsonl", n=BIG, bad={BIG - 5: line})
    data.write_text(data.read_text().replace('"def', '"' + "x" * 80 + " def"))  # > 1 MiB
    assert data.stat().st_size > 1 << 20
    err = refused(
        run_cli(capsys, "train", config(tmp_path, f"{{path: '{data}', type: completion}}")),
        f"d.jsonl line {BIG - 4}",
        *fragments,
    )
    assert not (tmp_path / "out").exists(), err


def test_a_bad_line_is_named_by_preprocess_too(tmp_path, capsys):
    data = jsonl(tmp_path / "d.jsonl", n=BIG, bad={BIG - 1: '{"text": "a"'})
    data.write_text(data.read_text().replace('"def', '"' + "x" * 80 + " def"))
    refused(
        run_cli(
            capsys,
            "preprocess",
            config(tmp_path, f"{{path: '{data}', type: completion}}", "sample_packing: true\n"),
        ),
        f"d.jsonl line {BIG}",
        "not valid JSON",
    )


def test_locator_names_csv_and_text_lines(tmp_path):
    from ndparallel.data.lines import first_bad_line

    csv_file = tmp_path / "d.csv"
    csv_file.write_text("text,label\nhello,1\n,2\nworld,3,4\n")
    assert "line 3: 'text' is empty" in first_bad_line([str(csv_file)], "csv", [("text",)], "text", "d")
    txt = tmp_path / "d.txt"
    txt.write_bytes(b"ok\nfine\nbad \xff byte\n")
    assert "line 3: not UTF-8 (invalid byte at column 5)" in first_bad_line([str(txt)], "text", [], None, "d")
    good = jsonl(tmp_path / "g.jsonl", n=5)
    assert first_bad_line([str(good)], "json", [("text",)], "text", "d") is None


def test_dry_run_says_what_each_dataset_is_read_as(tmp_path, capsys):
    """--dry-run (no data read, nothing tokenised) names per dataset the format, where that came from,
    and what trains; a dataset train would refuse is said to be refused; a path not on this machine
    is described, not refused (the dry run may be for another machine)."""
    data = jsonl(tmp_path / "t.jsonl")
    alpaca = tmp_path / "a.jsonl"
    alpaca.write_text(json.dumps({"instruction": "say hi", "input": "", "output": "hi"}) + "\n")
    cfg = config(
        tmp_path,
        f"{{path: {data}, type: completion}}, {{path: {alpaca}, type: alpaca}}, "
        f"{{path: {data}, ds_type: json}}, {{path: {data}, type: text}}, "
        f"{{path: {tmp_path / 'elsewhere.parquet'}, type: alpaca}}",
    )
    code, out, err = run_cli(capsys, "train", cfg, "--dry-run")
    assert code == 0, err
    lines = [line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("dataset ")]
    assert lines[0] == (
        "datasets[0]: t.jsonl read as JSON records (from the extension); type completion: raw text, "
        "every token trained (column 'text' of records)"
    ), lines
    assert (
        lines[1] == "datasets[1]: a.jsonl read as JSON records (from the extension); alpaca: prompt masked, "
        "response trained"
    )
    assert lines[2].startswith("datasets[2]: t.jsonl read as JSON records (from ds_type)"), lines
    assert lines[3].startswith(
        "datasets[3]: refused by train: datasets[3].type: 'text' would read t.jsonl"
    ), lines
    assert "not on this machine" in lines[4] and "alpaca: prompt masked" in lines[4], lines
    assert len(lines) == 5, lines
    assert "more samples : masked part marked: ndparallel preprocess CONFIG --show 4" in out
    samples = [line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("first sample ")]
    assert samples[0] == "datasets[0]: raw text, every token trained", samples
    assert "the built-in tokenizer of a preset model is trained when the run starts" in samples[1], samples
    assert not (tmp_path / "cache").exists()  # nothing read or tokenised


def test_dry_run_shows_the_first_trained_sample_of_each_dataset(tmp_path, capsys):
    """With the data and the tokenizer on this machine, --dry-run shows each dataset's first sample as
    train will tokenise it, trained runs in [[ ]]; one record read, nothing cached or written."""
    from sft_fixtures import chat_records, llama3_tokenizer, write_jsonl

    llama3_tokenizer().save_pretrained(tmp_path / "tok")
    alpaca = tmp_path / "a.jsonl"
    alpaca.write_text(
        json.dumps({"instruction": "say hi", "input": "", "output": "hi there"}) + "\n" + "{broken\n"
    )
    write_jsonl(tmp_path / "c.jsonl", chat_records(3))
    cfg = config(
        tmp_path,
        f"{{path: {alpaca}, type: alpaca}}, {{path: {tmp_path / 'c.jsonl'}, type: chat_template, "
        "chat_template: llama3}, {path: nobody/elsewhere, type: alpaca}",
        extra=f"tokenizer: {tmp_path / 'tok'}\nsequence_len: 256\n",
    )
    code, out, err = run_cli(capsys, "train", cfg, "--dry-run")
    assert code == 0, err
    samples = [line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("first sample ")]
    assert samples[0].startswith("datasets[0]: ") and "### Instruction:\\nsay hi" in samples[0], samples
    assert samples[0].endswith("### Response:\\n[[hi there<|end_of_text|>]]"), samples  # the prompt is masked
    chat = samples[1]
    assert "<|start_header_id|>user<|end_header_id|>" in chat and chat.count("[[") == chat.count("]]") >= 1, (
        chat
    )
    assert "<|start_header_id|>user" not in "".join(part.split("]]")[0] for part in chat.split("[[")[1:]), (
        chat
    )
    assert samples[2] == "datasets[2]: not shown (a Hub dataset: read where it runs)", samples
    assert not (tmp_path / "cache").exists() and not (tmp_path / "out").exists()
