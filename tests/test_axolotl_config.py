"""Axolotl's ND-parallel example configs (tests/fixtures/axolotl, unchanged): accepted, each remaining
difference explained in one line by --dry-run; the Llama one trains to the end on CPU ranks with
only base_model, the dataset path and output_dir pointed at local things; what stays unsupported is
refused before launch, one problem per line; data problems are found before any rank starts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cli_helpers import forbid_launch, run_cli, train_on_forked_ranks
from sft_fixtures import alpaca_records, tiny_llama_dir, write_jsonl

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures" / "axolotl"
LLAMA = FIXTURES / "llama-3_1-8b-hsdp-tp.yaml"
QWEN = FIXTURES / "qwen3-8b-fsdp-tp-cp.yaml"
RECORDS = 24
"""Alpaca records of the seed config's local dataset: 8 optimizer steps at 8 ranks and sequence_len 256
(2 epochs, a checkpoint each), enough for every assertion below."""


@pytest.fixture(autouse=True)
def _never_launch(monkeypatch):
    """A case must be refused before any rank starts."""
    forbid_launch(monkeypatch)


@pytest.fixture(scope="module")
def local(tmp_path_factory):
    """The Llama seed config with base_model, the dataset path and output_dir made local."""
    d = tmp_path_factory.mktemp("seed")
    tiny_llama_dir(d / "tiny-llama3")
    write_jsonl(d / "alpaca.jsonl", alpaca_records(RECORDS))
    text = (
        LLAMA.read_text()
        .replace("base_model: meta-llama/Llama-3.1-8B", f"base_model: {d / 'tiny-llama3'}")
        .replace("path: tatsu-lab/alpaca", f"path: {d / 'alpaca.jsonl'}")
        .replace("output_dir: ./outputs/ndp-out/", f"output_dir: {d / 'out'}")
    )
    changed = [a for a, b in zip(LLAMA.read_text().splitlines(), text.splitlines()) if a != b]
    assert len(changed) == 3, changed
    (d / "seed.yaml").write_text(text)
    return d


@pytest.mark.parametrize("config", [LLAMA, QWEN], ids=["llama-hsdp-tp", "qwen3-fsdp-tp-cp"])
def test_seed_configs_dry_run_explain_each_difference(capsys, config):
    code, out, err = run_cli(capsys, "train", config, "--dry-run")
    assert code == 0, err
    notes = [line for line in out.splitlines() if line.startswith("note")]
    assert len({n.split(":")[1] for n in notes}) == len(notes)  # one line per field
    text = "\n".join(notes)
    for field in (
        "plugins: CutCrossEntropyPlugin",
        "state_dict_type: FULL_STATE_DICT",
        "adamw_torch_fused",
        "warmup_ratio: 0.1",
        "saves_per_epoch: 1",
        "attn_implementation: flash_attention_2",
        "tf32",
    ):
        assert field in text, (field, out)
    assert "alpaca: whole samples, packed several per row" in out and "prompt tokens masked" in out


def test_seed_fields_map_to_ndparallel():
    from ndparallel.axolotl import load_config

    cfg = load_config(LLAMA)
    assert cfg.fsdp_config.layer_classes == ["LlamaDecoderLayer"] and cfg.fsdp_config.cpu_offload is False
    assert cfg.dataset_cache_dir == "last_run_prepared" and cfg.special_tokens.pad_token == "<|end_of_text|>"
    assert cfg.attn_implementation == "flash_attention_2" and cfg.sample_packing and cfg.learning_rate == 2e-6
    assert load_config(QWEN).special_tokens is None  # an empty `special_tokens:` is accepted


@pytest.mark.parametrize(
    "extra, fragment",
    [
        ("plugins: [axolotl.integrations.diffusion.DiffusionPlugin]", "not supported; ndparallel maps only"),
        ("fsdp_version: 3", "only FSDP2 exists here"),
        ("fsdp_config: {auto_wrap_policy: NO_WRAP}", "'NO_WRAP' is not supported"),
        ("gradient_checkpointing: offload_disk", "offloading to disk is not supported"),
        ("datasets: [{path: x.jsonl, type: sharegpt}]", "use chat_template"),
        ("warmup_steps: 10", "'warmup_steps' and 'warmup_ratio' are both set"),
    ],
)
def test_unsupported_is_refused_in_one_line(tmp_path, capsys, extra, fragment):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(LLAMA.read_text() + "\n" + extra + "\n")
    code, _, err = run_cli(capsys, "train", cfg, "--dry-run")
    assert code == 2 and fragment in err and len(err.strip().splitlines()) == 1, err


def test_several_problems_one_per_line(tmp_path, capsys):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(LLAMA.read_text() + "\nfsdp_version: 3\nload_in_8bit: true\nlr_schedulr: cosine\n")
    code, _, err = run_cli(capsys, "train", cfg, "--dry-run")
    lines = err.strip().splitlines()
    assert code == 2 and lines[0].endswith("3 problems:") and len(lines) == 4, err
    assert "fsdp_version" in err and "an 8-bit base (load_in_8bit) is not supported" in err
    assert "did you mean 'lr_scheduler'" in err


def test_layer_class_of_another_model_is_refused(local, capsys):
    code, _, err = run_cli(
        capsys,
        "train",
        local / "seed.yaml",
        "--dry-run",
        "--set",
        "fsdp_config.transformer_layer_cls_to_wrap=Qwen3DecoderLayer",
    )
    assert code == 2 and "['Qwen3DecoderLayer'] is not a class of" in err and "LlamaDecoderLayer" in err, err


@pytest.mark.parametrize(
    "problem, setup, fragment",
    [
        (
            "a new special token with LoRA",
            {"set": ["special_tokens.pad_token=<pad>", "adapter=lora"]},
            "add 1 token(s) new to the vocabulary",
        ),
        ("unknown type", {"set": "datasets.0.type=alpacca"}, "did you mean 'alpaca'"),
        ("missing column", {"records": [{"instruction": "x", "answer": "y"}]}, "column 'output' is not in"),
        ("bad JSON line after the first MiB", {"bad_line_at": 1 << 21}, "not valid JSON"),
        (
            "a null output in a record",
            {"records": [*alpaca_records(5), {"instruction": "x", "output": None}]},
            "datasets[0] row 5: column 'output' is missing or null",
        ),
        (
            "unknown chat template",
            {
                "records": [{"messages": [{"role": "user", "content": "hi"}]}],
                "set": ["datasets.0.type=chat_template", "datasets.0.chat_template=zephyr"],
            },
            "unknown template 'zephyr'",
        ),
        (
            "nothing left after filtering",
            {
                "records": [{"instruction": "word " * 400, "output": "y"}],
                "set": "excess_length_strategy=drop",
            },
            "no sample left to train on",
        ),
    ],
)
def test_data_problems_found_before_launch(local, tmp_path, capsys, problem, setup, fragment):
    data = tmp_path / "d.jsonl"
    if "bad_line_at" in setup:
        lines = [json.dumps(r) for r in alpaca_records(2000)]
        while sum(len(x) + 1 for x in lines) < setup["bad_line_at"]:
            lines += lines
        data.write_text("\n".join([*lines, "{not json"]) + "\n")
    else:
        write_jsonl(data, setup.get("records", alpaca_records(8)))
    sets = [
        "--set",
        f"datasets.0.path={data}",
        "--set",
        f"output_dir={tmp_path / 'out'}",
        "--set",
        f"dataset_prepared_path={tmp_path / 'cache'}",
        "--set",
        "sequence_len=256",
        "--set",
        "dp_shard_size=2",
    ]
    for item in [setup["set"]] if isinstance(setup.get("set"), str) else setup.get("set", []):
        sets += ["--set", item]
    code, _, err = run_cli(capsys, "train", local / "seed.yaml", *sets)
    assert code == 2 and fragment in err, (problem, err)
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert err.startswith("ndparallel train: error:"), err


def test_preprocess_json_and_show(local, tmp_path, capsys):
    from ndparallel.axolotl import load_config

    sets = ["--set", f"dataset_prepared_path={tmp_path / 'cache'}", "--set", "sequence_len=256"]
    code, out, err = run_cli(capsys, "preprocess", local / "seed.yaml", "--json", *sets)
    assert code == 0, err
    samples = [json.loads(line) for line in out.splitlines()]
    assert len(samples) == RECORDS and f"{RECORDS} records -> {RECORDS} samples" in err
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(load_config(local / "seed.yaml").base_model)
    for s, record in zip(samples, alpaca_records(RECORDS)):  # dataset order, prompt masked
        trained = [t for t, lab in zip(s["input_ids"], s["labels"]) if lab != -100]
        assert tok.decode(trained) == record["output"] + "<|end_of_text|>"
    code, out, _ = run_cli(capsys, "preprocess", local / "seed.yaml", "--show", "2", *sets)
    assert code == 0 and out.count("--- sample") == 2
    assert f"[[{alpaca_records(1)[0]['output']}<|end_of_text|>]]" in out  # trained run highlighted
    assert list((tmp_path / "cache" / "rows").glob("*/meta.json"))  # cached as train will use it


def test_custom_instruction_format_end_to_end(local, tmp_path, capsys):
    """Axolotl's `type: {format: ...}` on the seed's alpaca data: preprocess masks the prompt the
    format builds; a column the format names but the data lacks is refused before launch."""
    fmt = (
        '{format: "[INST] {instruction} {input} [/INST]\\n", '
        'no_input_format: "[INST] {instruction} [/INST]\\n"}'
    )
    sets = [
        "--set",
        f"dataset_prepared_path={tmp_path / 'cache'}",
        "--set",
        "sequence_len=256",
        "--set",
        f"datasets.0.type={fmt}",
    ]
    code, out, err = run_cli(capsys, "preprocess", local / "seed.yaml", "--json", *sets)
    assert code == 0, err
    from transformers import AutoTokenizer

    from ndparallel.axolotl import load_config

    tok = AutoTokenizer.from_pretrained(load_config(local / "seed.yaml").base_model)
    for line, record in zip(out.splitlines(), alpaca_records(RECORDS)):
        s = json.loads(line)
        prompt = [t for t, lab in zip(s["input_ids"], s["labels"]) if lab == -100]
        trained = [t for t, lab in zip(s["input_ids"], s["labels"]) if lab != -100]
        turn = (
            f"[INST] {record['instruction']} {record['input']} [/INST]\n"
            if record["input"]
            else f"[INST] {record['instruction']} [/INST]\n"
        )
        assert tok.decode(prompt) == "<|begin_of_text|>" + turn
        assert tok.decode(trained) == record["output"] + "<|end_of_text|>"
    bad = "{format: '{instruction}', field_output: answer}"
    code, _, err = run_cli(capsys, "train", local / "seed.yaml", *sets[:4], "--set", f"datasets.0.type={bad}")
    assert code == 2 and "column 'answer'" in err, err
    assert len(err.strip().splitlines()) == 1, err


@pytest.mark.slow
@pytest.mark.timeout(300)  # a real multi-rank launch, 40-95 s on 2 cores: over the 120 s default budget
def test_seed_config_trains_to_the_end_on_cpu_ranks(local):
    """The Llama seed config, only base_model / dataset path / output_dir changed; for the CPU:
    dp_shard_size 4 -> 2 (8 ranks instead of 16) and sequence_len 2048 -> 256."""
    proc = train_on_forked_ranks(
        ["train", local / "seed.yaml", "--set", "dp_shard_size=2", "--set", "sequence_len=256"], cwd=local
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = local / "out"
    assert (out / "final" / "model.safetensors").is_file()
    assert proc.stdout.count("attn_implementation flash_attention_2 is not available") == 1
    checkpoints = sorted(p.name for p in out.glob("checkpoint-*"))
    assert len(checkpoints) == 2, checkpoints  # saves_per_epoch: 1, num_epochs: 2
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(out / "final")
    assert model.config.num_hidden_layers == 2
    assert AutoTokenizer.from_pretrained(out / "final").pad_token == "<|end_of_text|>"  # special_tokens
    assert (local / "last_run_prepared" / "rows").is_dir()  # dataset_prepared_path, relative to the cwd
