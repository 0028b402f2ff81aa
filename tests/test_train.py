"""End to end: `ndparallel train` runs, writes metrics and a loadable model; a 3-D layout trains the
same model as one rank; `ndparallel verify` passes a right layout and fails a broken one."""

import json
from pathlib import Path

import pytest

import faults
from cli_helpers import train_on_forked_ranks
from ndparallel.axolotl import load_config
from ndparallel.testing import run_on_ranks
from output_origin import recorded_output

ROOT = Path(__file__).resolve().parents[1]
SMALL_DATA = [
    "datasets=[{path: 'builtin:stdlib', max_bytes: 200000}]",
    "tokenizer_vocab_size=512",
    "sequence_len=32",
    "val_set_size=0.05",
]


def _losses(run_dir: Path) -> list[float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if "loss" in r]


def test_quickstart_cli_writes_metrics_and_a_model_that_generates(tmp_path):
    """The README's first command, its layout (FSDP 2 × CP 2 × TP 2) and a few steps, on ranks
    forked from this process (the elastic launch itself is tested by test_cluster /
    test_faults_launcher / test_harness_and_launch): every line of its output is ndparallel's, none
    a library's (``output_origin.py``: a warning, a log record, a C++ message, a traceback)."""
    out_dir = tmp_path / "run"
    sets = [
        "max_steps=4",
        "logging_steps=2",
        "eval_steps=4",
        f"output_dir={out_dir}",
        f"dataset_cache_dir={tmp_path / 'cache'}",
        *SMALL_DATA,
    ]
    proc = train_on_forked_ranks(
        ["train", ROOT / "examples" / "quickstart.yaml", *[a for s in sets for a in ("--set", s)]], cwd=ROOT
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "step 4: loss" in proc.stdout and "eval_loss" in proc.stdout
    assert proc.foreign == [], proc.foreign[:20]
    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 4]  # the first step, then every logging_steps
    for key in (
        "lr",
        "grad_norm",
        "tokens_per_s",
        "tokens_per_s_per_device",
        "tflops_per_device",
        "peak_memory_gb",
    ):
        assert steps[-1][key] > 0 or key == "lr"
    assert any("eval_perplexity" in r for r in rows)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(out_dir / "final")
    tok = AutoTokenizer.from_pretrained(out_dir / "final")
    ids = tok("def main(", return_tensors="pt").input_ids
    gen = model.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=tok.pad_token_id)
    assert gen.shape[1] == ids.shape[1] + 5


def _train(cfg_path: str, overrides: list[str]):
    from ndparallel.training.trainer import run_training

    run_training(load_config(cfg_path, overrides))
    return True


@pytest.mark.slow
def test_3d_layout_train_equals_one_rank(tmp_path):
    """FSDP 2 × CP 2 × TP 2 (8 ranks, micro-batch 2 per dp rank) vs 1 rank with micro-batch 4."""
    common = [
        *SMALL_DATA,
        "max_steps=3",
        "save_final_model=false",
        "logging_steps=1",
        f"dataset_cache_dir={tmp_path / 'cache'}",
        "base_model=tiny-llama",
        "learning_rate=1e-2",
        "sequence_parallel=true",
        "loss_parallel=true",
    ]
    run_on_ranks(_train, 1, None, [*common, "micro_batch_size=4", f"output_dir={tmp_path / 'one'}"])
    run_on_ranks(
        _train,
        8,
        None,
        [
            *common,
            "micro_batch_size=2",
            "dp_shard_size=2",
            "context_parallel_size=2",
            "tensor_parallel_size=2",
            f"output_dir={tmp_path / 'nd'}",
        ],
        timeout_s=500,
    )
    one, nd = _losses(tmp_path / "one"), _losses(tmp_path / "nd")
    assert len(one) == len(nd) == 3
    for a, b in zip(one, nd):
        assert abs(a - b) / a <= 1e-5, (one, nd)


def _verify(cfg_overrides, example="examples/cpu/fsdp_tp.yaml"):
    """``ndparallel verify`` as the command line runs it."""
    from ndparallel.cli import main

    return main(["verify", example, "--steps", "2", *[f"--set={s}" for s in cfg_overrides]])


def test_verify_passes_right_layout_and_fails_broken_one(monkeypatch, capsys):
    """FSDP 2 × TP 2 passes, every line of its output ndparallel's (no library's warning or log
    record: ``output_origin.py``); a layout that skips the gradient reduction fails."""
    monkeypatch.chdir(ROOT)
    with recorded_output() as output:
        code = _verify([])
    assert code == 0, output.stdout[-2000:] + output.stderr[-4000:]
    assert "PASS" in output.stdout and "of its bound" in output.stdout  # the verdict names its bound
    assert output.foreign() == [], output.foreign()[:20]
    faults.unrecorded(monkeypatch)
    faults.skip_grad_sync(monkeypatch)
    assert _verify([]) == 1
    assert "FAIL" in capsys.readouterr().out


def test_verify_cp_ulysses_on_packed_documents_and_catches_a_document_leak(monkeypatch, capsys):
    """verify packs rows with documents: CP (ulysses) passes; attending across documents fails."""
    monkeypatch.chdir(ROOT)
    assert _verify(["cp_comm_strategy=ulysses"], "examples/cpu/cp.yaml") == 0
    assert "PASS" in capsys.readouterr().out
    faults.unrecorded(monkeypatch)
    faults.cross_documents(monkeypatch)
    assert _verify([], "examples/cpu/cp.yaml") == 1
    assert "FAIL" in capsys.readouterr().out


def test_train_resumes_from_a_checkpoint_and_continues_identically(tmp_path):
    """Run 4 steps saving every 2; drop the last checkpoint and resume (auto) from step 2: steps 3
    and 4 repeat the uninterrupted run's losses exactly (same layout: same data, RNG, optimizer)."""
    import shutil

    out = tmp_path / "run"
    common = [
        *SMALL_DATA,
        "max_steps=4",
        "save_steps=2",
        "save_final_model=false",
        "logging_steps=1",
        f"dataset_cache_dir={tmp_path / 'cache'}",
        "base_model=tiny-llama",
        "dp_shard_size=2",
        f"output_dir={out}",
    ]
    run_on_ranks(_train, 2, None, common)
    full = _losses(out)
    shutil.rmtree(out / "checkpoint-4")
    (out / "metrics.jsonl").unlink()
    run_on_ranks(_train, 2, None, [*common, "resume_from_checkpoint=auto"])
    resumed = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in resumed if "loss" in r] == [3, 4]
    assert [r["loss"] for r in resumed if "loss" in r] == full[2:]


def _train_profiled(overrides):
    from ndparallel.training.trainer import run_training

    run_training(load_config(None, overrides), profile_comm=True)
    return True


def test_profile_comm_writes_per_rank_tables(tmp_path, capfd):
    out = tmp_path / "run"
    run_on_ranks(
        _train_profiled,
        2,
        [
            *SMALL_DATA,
            "max_steps=3",
            "save_final_model=false",
            f"dataset_cache_dir={tmp_path / 'cache'}",
            "base_model=tiny-llama",
            "dp_shard_size=2",
            f"output_dir={out}",
        ],
    )
    for rank in (0, 1):
        rows = json.loads((out / "comm_profile" / f"rank-{rank:05d}.json").read_text())["rows"]
        ops = {(r["dim"], r["op"]) for r in rows}
        # FSDP shards over dp_shard_cp (= dp_shard here): its own group, now that every mesh group is
        # created with the job's timeout instead of reusing the default group
        assert {("dp_shard_cp", "all_gather"), ("dp_shard_cp", "reduce_scatter")} <= ops, ops
        assert all(r["bytes"] > 0 and r["count"] > 0 for r in rows)
    assert "collectives per rank, steady step" in capfd.readouterr().out
