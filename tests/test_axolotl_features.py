"""The Axolotl features an example config needs, each on its own: the data-parallel default, split
slices and data_files, Alpaca's styles, min_sample_len, the streamed pre-training loader (= one
process's blocks, documents kept apart), a validation split smaller than one global batch, trackers
refused before launch when absent, the run controls (early stopping, the loss watchdog, the cosine
floor) and unfrozen_parameters under FSDP2."""

from __future__ import annotations

import json
import sys

import pytest
import torch

from cli_helpers import forbid_launch, run_cli
from ndparallel.axolotl import ConfigError, load_config
from ndparallel.testing import run_on_ranks
from sft_fixtures import alpaca_records, llama3_tokenizer, tiny_llama_dir, write_jsonl


@pytest.fixture(autouse=True)
def _never_launch(monkeypatch):
    forbid_launch(monkeypatch)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny_llama_dir(tmp_path_factory.mktemp("m") / "llama")


def _cfg(tmp_path, text: str):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    return path


def test_no_degrees_is_data_parallel_over_the_local_devices(tmp_path, capsys, model):
    write_jsonl(tmp_path / "a.jsonl", alpaca_records(8))
    base = f"base_model: {model}\ndatasets: [{{path: {tmp_path / 'a.jsonl'}, type: alpaca}}]\n"
    code, out, err = run_cli(capsys, "train", _cfg(tmp_path, base), "--dry-run", "--nproc-per-node", "2")
    assert code == 0 and "DP 2" in out and "data parallel over every local device" in out, err
    code, out, err = run_cli(
        capsys,
        "train",
        _cfg(tmp_path, base + "fsdp_config: {offload_params: false}\n"),
        "--dry-run",
        "--nproc-per-node",
        "2",
    )
    assert code == 0 and "FSDP 2" in out, err
    code, out, err = run_cli(capsys, "train", _cfg(tmp_path, base), "--dry-run")  # CPU, no --nproc-per-node
    assert code == 0 and "layout       : single device" in out, err
    code, _, err = run_cli(
        capsys, "train", _cfg(tmp_path, base + "dp_shard_size: 4\n"), "--dry-run", "--nproc-per-node", "2"
    )
    assert code == 2 and "needs 4 ranks" in err  # explicit degrees still decide


def test_split_slices_data_files_and_alpaca_styles(tmp_path):
    from ndparallel.data.dataset import load_records
    from ndparallel.data.prompts import render

    data = tmp_path / "d"
    data.mkdir()
    write_jsonl(data / "a.jsonl", alpaca_records(10))
    write_jsonl(data / "b.jsonl", alpaca_records(30, seed=5))
    spec = {"path": str(data), "type": "alpaca", "data_files": ["b.jsonl"], "split": "train[:20%]"}
    records = load_records(spec)
    assert len(records) == 6 and records[0]["output"] == alpaca_records(30, seed=5)[0]["output"]
    with pytest.raises(ConfigError, match="is not a split"):
        load_config(_cfg(tmp_path, "base_model: tiny-llama\ndatasets: [{path: x, split: 'train[:20'}]\n"))
    from ndparallel.data.dataset import DatasetSpec

    record = {"instruction": "Name a colour.", "input": "", "output": "Red."}
    chat = render(record, DatasetSpec(path="x", type="alpaca:chat"), "t")
    assert chat.segments[0][0].endswith("USER: Name a colour.\nASSISTANT:") and chat.segments[1] == (
        "Red.",
        True,
    )
    phi = render(record, DatasetSpec(path="x", type="alpaca:phi"), "t")
    assert "<|user|>\nName a colour.<|end|>\n<|assistant|>\n" in phi.segments[0][0]


def test_min_sample_len_drops_short_samples(tmp_path):
    from ndparallel.data.dataset import DatasetSpec
    from ndparallel.data.prepare import DataOptions, prepare_samples

    write_jsonl(tmp_path / "a.jsonl", alpaca_records(20))
    tok = llama3_tokenizer()
    spec = [DatasetSpec(path=str(tmp_path / "a.jsonl"), type="alpaca")]
    every = prepare_samples(spec, tok, DataOptions(sequence_len=512))
    lengths = sorted(int(e - s) for _, _, s, e in every.samples)
    cut = lengths[len(lengths) // 2]
    fewer = prepare_samples(spec, tok, DataOptions(sequence_len=512, min_sample_len=cut))
    assert len(fewer) == sum(n >= cut for n in lengths) and fewer.stats.dropped_too_short > 0


def test_streamed_blocks_are_one_process_blocks_split_over_dp_ranks(tmp_path):
    from ndparallel.data.dataset import DatasetSpec
    from ndparallel.data.stream import StreamingLoader, TokenStream

    write_jsonl(tmp_path / "t.jsonl", [{"text": r["output"]} for r in alpaca_records(40)])
    stream = TokenStream([DatasetSpec(path=str(tmp_path / "t.jsonl"))], llama3_tokenizer(), 32)
    one = StreamingLoader(stream, 4, length=10, per_document=True)
    ranks = [StreamingLoader(stream, 2, dp_rank=r, dp_size=2, length=10, per_document=True) for r in (0, 1)]
    for i in (0, 1, 2, 0):  # in order, then back to the start (a resume re-reads the stream)
        full = one.micro_batch(i)
        parts = [loader.micro_batch(i) for loader in ranks]
        for key in full:
            assert torch.equal(full[key], torch.cat([p[key] for p in parts]))
    batch = one.micro_batch(1)
    eos = llama3_tokenizer().eos_token_id
    restarts = batch["position_ids"][:, 1:] == 0
    assert restarts.any()  # several documents per block, positions restart at each
    after_eos = batch["input_ids"][:, :-1] == eos
    assert torch.equal(restarts, after_eos)  # a document starts right after an eos
    assert (batch["shift_labels"][batch["input_ids"] == eos] == -100).all()  # no label crosses a document end


def test_a_validation_split_smaller_than_one_global_batch_is_evaluated_whole():
    from ndparallel.data import PackedLoader
    from ndparallel.data.padded import padded_to

    rows = torch.arange(3 * 9, dtype=torch.int32).reshape(3, 9)  # 3 blocks of sequence_len 8
    padded = padded_to(rows, 4)  # dp 2 x micro-batch 2
    batches = [PackedLoader(padded, 2, dp_rank=r, dp_size=2, shuffle=False).micro_batch(0) for r in (0, 1)]
    labels = torch.cat([b["shift_labels"] for b in batches])
    assert labels.shape[0] == 4 and torch.equal(labels[:3], rows[:, 1:].long())
    assert (labels[3] == -100).all()  # the padding row adds no token to the loss


def test_trackers_missing_packages_are_refused_before_launch(tmp_path, capsys, model, monkeypatch):
    for module in ("wandb", "tensorboard", "tensorboardX"):
        monkeypatch.setitem(sys.modules, module, None)  # not installed, as import and find_spec see it
    write_jsonl(tmp_path / "a.jsonl", alpaca_records(8))
    cfg = _cfg(
        tmp_path,
        f"base_model: {model}\ndatasets: [{{path: {tmp_path / 'a.jsonl'}, type: alpaca}}]\n"
        f"output_dir: {tmp_path / 'out'}\nwandb_project: p\nuse_tensorboard: true\n",
    )
    code, _, err = run_cli(capsys, "train", cfg)
    assert code == 2 and err.strip() == (
        "ndparallel train: error: the wandb tracker needs wandb; the tensorboard tracker needs "
        "tensorboardX, not installed here: pip install 'ndparallel[trackers]'"
    ), err
    code, out, _ = run_cli(capsys, "train", cfg, "--dry-run")
    assert code == 0 and "trackers     : metrics.jsonl + wandb, tensorboard (the wandb tracker needs" in out


def test_run_controls():
    from ndparallel.engine.nonfinite import NonFiniteError
    from ndparallel.optim.build import cosine_factor
    from ndparallel.training.controls import EarlyStopping, LossWatchdog, eval_every

    assert (
        eval_every(None, 4, 10) == 2 and eval_every(5, None, 10) == 5 and eval_every(None, None, 10) is None
    )
    stop = EarlyStopping(2)
    assert [stop.should_stop(x) for x in (3.0, 2.0, 2.5, 2.1)] == [False, False, False, True]
    dog = LossWatchdog(5.0, patience=2, action="fail")  # the explicit hard stop
    assert [dog.check(1, 6.0), dog.check(2, 4.0), dog.check(3, 6.0)] == [None] * 3
    with pytest.raises(NonFiniteError, match="loss_watchdog_threshold=5"):
        dog.check(4, 7.0)
    dog = LossWatchdog(5.0, patience=2)  # Axolotl's: a warning line, the trainer stops gracefully
    assert [dog.check(1, 6.0), dog.check(2, 4.0), dog.check(3, 6.0)] == [None] * 3
    assert "stopping training as Axolotl does" in dog.check(4, 7.0)
    kw = dict(warmup_steps=2, total_steps=10)
    assert cosine_factor(1, **kw, quadratic_warmup=True) == 0.25 and cosine_factor(2, **kw) == 1.0
    assert cosine_factor(10, **kw, min_lr_ratio=0.1) == pytest.approx(0.1)
    assert cosine_factor(8, **kw, min_lr_ratio=0.1, constant_lr_ratio=0.6) == pytest.approx(0.1)  # held


def _train_as_the_cli_does(cfg_path: str) -> tuple[int, str]:
    """``ndparallel train``'s rank function on this rank: its exit code and what it printed."""
    import contextlib
    import io

    from ndparallel.cli.commands import _train_on_rank

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = _train_on_rank(load_config(cfg_path), False, True)
    return code, out.getvalue()


def test_loss_watchdog_stops_gracefully_as_axolotl_does(tmp_path, model):
    """Axolotl's loss_watchdog_threshold ends the run normally: a warning, the final model saved,
    exit 0 (its callback sets should_training_stop); the note before launch says so.
    loss_watchdog_action: fail is the hard stop (exit 1, no final model)."""
    from ndparallel.preflight.checks import run_notes

    write_jsonl(tmp_path / "a.jsonl", alpaca_records(24))
    text = (
        f"base_model: {model}\ndatasets: [{{path: {tmp_path / 'a.jsonl'}, type: alpaca}}]\n"
        f"output_dir: {tmp_path / 'out'}\nsequence_len: 128\nmax_steps: 4\nlogging_steps: 1\ndevice: cpu\n"
        "loss_watchdog_threshold: 0.01\nloss_watchdog_patience: 2\n"
    )  # a tiny model's loss is ~5
    cfg = _cfg(tmp_path, text)
    assert any("stops training as Axolotl does" in n for n in run_notes(load_config(cfg)))
    code, printed = run_on_ranks(_train_as_the_cli_does, 1, str(cfg))[0]
    assert code == 0 and "warning: step 2: the loss" in printed, printed
    steps = [
        json.loads(line).get("step") for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()
    ]
    assert max(steps) == 2 and (tmp_path / "out" / "final" / "model.safetensors").is_file(), steps
    hard = _cfg(tmp_path, text.replace("/out", "/hard") + "loss_watchdog_action: fail\n")
    assert any("exits 1 without a final model" in n for n in run_notes(load_config(hard)))
    from ndparallel.engine.nonfinite import NonFiniteError
    from ndparallel.testing import RankFailure

    with pytest.raises(RankFailure, match=NonFiniteError.__name__):
        run_on_ranks(_frozen_run, 1, str(hard))
    assert not (tmp_path / "hard" / "final").exists()


def _frozen_run(cfg_path: str) -> dict:
    from ndparallel.training.trainer import run_training

    run_training(load_config(cfg_path))
    return {}


def test_unfrozen_parameters_under_fsdp2(tmp_path, model):
    """Only the matching parameters change (2 ranks, FSDP2); a pattern matching nothing is refused."""
    write_jsonl(tmp_path / "a.jsonl", alpaca_records(24))
    cfg = _cfg(
        tmp_path,
        f"base_model: {model}\ndatasets: [{{path: {tmp_path / 'a.jsonl'}, type: alpaca}}]\n"
        f"output_dir: {tmp_path / 'out'}\ndataset_prepared_path: {tmp_path / 'cache'}\n"
        "sequence_len: 128\nmax_steps: 2\nlearning_rate: 0.01\ndp_shard_size: 2\ndevice: cpu\n"
        "unfrozen_parameters: ['^lm_head', 'model\\.layers\\.1\\.mlp']\n",
    )
    from ndparallel.preflight.local import prepare_data

    prepare_data(load_config(cfg))  # the ranks find the data cached
    run_on_ranks(_frozen_run, 2, str(cfg))
    from safetensors.torch import load_file

    before, after = (
        load_file(model / "model.safetensors"),
        load_file(tmp_path / "out" / "final" / "model.safetensors"),
    )
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed and all(k.startswith(("lm_head", "model.layers.1.mlp")) for k in changed), sorted(changed)
    assert "lm_head.weight" in changed and "model.layers.1.mlp.up_proj.weight" in changed
    bad = _cfg(tmp_path, cfg.read_text().replace("'^lm_head'", "'^head_of_lm'"))
    with pytest.raises(ConfigError, match="matches no parameter"):
        from ndparallel.preflight.checks import validate_layout

        validate_layout(load_config(bad), 2, check_local=False)
    assert json.loads((tmp_path / "out" / "metrics.jsonl").read_text().splitlines()[0])["step"] == 1
