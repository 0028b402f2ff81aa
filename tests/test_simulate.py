"""``ndparallel simulate``: one real rank of a 64-rank world under torch's fake backend, measured
against the planner — tensor memory within 15 % and the same collective bytes per mesh dim, for
FSDP (full blocks of text) and FSDP × CP × TP (micro-batches cut after their longest row: both
at the one width the planner is asked about); a memory budget below the measured peak fails the
run (exit 1)."""

import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PARITY = ROOT / "tests/fixtures/axolotl/parity"  # a tokenizer and Axolotl's alpaca records
MODEL = dict(
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    vocab_size=2048,
    max_position_embeddings=1024,
    tie_word_embeddings=False,
)
KEYS = [
    ("measured", "peak_memory_gib"),
    ("measured", "step_time_s"),
    ("predicted", "peak_memory_gib"),
    ("predicted", "step_time_s"),
]


@pytest.fixture(scope="module")
def config(tmp_path_factory):
    from transformers import LlamaConfig

    tmp = tmp_path_factory.mktemp("simulate")
    LlamaConfig(**MODEL).save_pretrained(tmp / "model")  # config.json only: no weights are read
    path = tmp / "cfg.yaml"
    path.write_text(
        f"base_model: {tmp / 'model'}\ntokenizer: builtin:stdlib\n"
        "datasets:\n  - {path: builtin:stdlib, max_files: 60}\n"
        f"sequence_len: 256\nmicro_batch_size: 2\noutput_dir: {tmp / 'run'}\n"
    )
    return path


@pytest.fixture(scope="module")
def cut_config(config):
    """Alpaca records, unpacked and ``pad_to_sequence_len`` unset: each micro-batch cut after its
    longest row (the model and output directory of ``config``)."""
    path = config.parent / "cut.yaml"
    path.write_text(
        f"base_model: {config.parent / 'model'}\ntokenizer: {PARITY / 'model'}\n"
        f"datasets:\n  - {{path: {PARITY / 'data' / 'alpaca.jsonl'}, type: alpaca}}\n"
        f"sequence_len: 512\nmicro_batch_size: 2\noutput_dir: {config.parent / 'run'}\n"
    )
    return path


def _simulate(capfd, config, *args):
    """``ndparallel simulate`` from this process (its rank runs in a fresh child, as always):
    (exit code, the JSON report or None, stderr). Every line of the output is ndparallel's, none a
    library's (a warning, a log record, a C++ message: ``output_origin.py``)."""
    from cli_helpers import run_cli_recorded

    world = ("--world-size", "64", "--steps", "1", "--json")
    code, output = run_cli_recorded("simulate", config, *world, *args)
    assert output.foreign() == [], output.foreign()[:20]
    out, err = output.stdout, output.stderr
    return code, (json.loads(out) if out.strip().startswith("{") else None), err


def _check(report):
    for part, key in KEYS:
        assert report[part][key] > 0, (part, key)
    assert "loss" not in json.dumps(report["measured"])  # meaningless under fake collectives: never shown
    err = report["predicted"]["error"]["tensor_peak"]
    assert abs(err) <= 0.15, report["predicted"]
    got, want = report["collectives"], report["predicted_collectives"]
    assert {d: v["bytes"] for d, v in got.items()} == {d: v["bytes"] for d, v in want.items()}, (got, want)


def test_fsdp_rank_of_64_and_a_budget_it_does_not_fit(config, capfd):
    code, report, err = _simulate(capfd, config, "--set", "dp_shard_size=-1", "--gpu-mem", "0.01")
    assert report is not None, err[-2000:]
    assert report["layout"]["dp_shard_size"] == 64 and report["layout"]["world_size"] == 64
    _check(report)
    assert report["fits"] is False and code == 1 and "does not fit" in err


def test_fsdp_cp_tp_rank_of_64(cut_config, capfd, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    code, report, err = _simulate(
        capfd,
        cut_config,
        "--set",
        "dp_shard_size=-1",
        "--set",
        "context_parallel_size=2",
        "--set",
        "tensor_parallel_size=2",
        "--rank",
        "37",
    )
    assert code == 0, err[-2000:]
    assert report["layout"]["describe"] == "FSDP 16 + CP 2 + TP 2" and report["layout"]["rank"] == 37
    width = report["settings"]["row_length"]  # the p95 width (tests/test_plan_from_config.py)
    assert width % 8 == 0 and width < 512, report["settings"]
    assert report["settings"]["rows"].startswith(f"rows: dynamic, p95 {width} tokens of sequence_len 512")
    _check(report)  # measured and planned at that width
    assert {"dp_shard_cp", "cp", "tp"} <= set(report["collectives"])
    assert report["fits"] is None


def test_bad_rank_is_one_line(config, capsys):
    from cli_helpers import run_cli

    code, _, err = run_cli(capsys, "simulate", str(config), "--world-size", "8", "--rank", "8")
    assert code == 2 and "--rank 8 is not in a world of 8 ranks" in err and "Traceback" not in err


@pytest.mark.parametrize(
    "size, message", [("lots", "--gpu-mem 'lots': not a size"), ("0", "--gpu-mem '0': must be > 0")]
)
def test_bad_gpu_mem_is_one_line_as_in_plan(config, capsys, size, message):
    """``simulate`` reads ``--gpu-mem`` with the planner's parser (one message for both commands);
    only the planner's 1 GiB unit-slip floor is lifted, for the budgets of tiny CPU models."""
    from cli_helpers import run_cli

    code, _, err = run_cli(capsys, "simulate", str(config), "--world-size", "8", "--gpu-mem", size)
    assert code == 2 and message in err and "Traceback" not in err
