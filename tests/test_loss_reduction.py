"""``loss_reduction: micro_batch_mean`` (Axolotl's loss: the mean of the dp ranks' micro-batches' own
token means) under a layout equals one process over the same micro-batches, and differs from the
default global token mean when the micro-batches' token counts differ. Axolotl's own losses:
``tests/test_axolotl_parity.py``."""

import dataclasses

import pytest

from ndparallel.models.presets import preset_config
from ndparallel.testing import run_on_ranks
from ndparallel.tools.agreement import (
    assert_differs,
    assert_matches,
    one_process_reference,
    split_micro_batches,
)
from ndparallel.tools.equivalence import TrainSetup, make_global_batches, train_under_layout


def uneven(setup: TrainSetup) -> TrainSetup:
    """``setup``'s batches with 80 % of the labels of the second half of each step's first
    micro-batch ignored: the micro-batches (and the dp ranks' halves) train unequal token counts."""
    batches = make_global_batches(setup)
    half, cut = setup.global_micro_batch // 2, setup.seq_len * 4 // 5
    for step in batches:
        step[0]["shift_labels"][half:, :cut] = -100
    return dataclasses.replace(setup, batches=batches)


BASE = uneven(
    TrainSetup(
        preset_config("tiny-llama"),
        steps=3,
        global_micro_batch=4,
        grad_accum=2,
        seq_len=32,
        optimizer="sgd",
        lr=0.5,
        loss_reduction="micro_batch_mean",
    )
)


def _option_and_default(setup: TrainSetup, layout: dict):
    """Inside a rank: the layout's training with ``setup``'s loss_reduction, then with the default."""
    default = dataclasses.replace(setup, loss_reduction="global_token_mean")
    return train_under_layout(setup, layout), train_under_layout(default, layout)


def test_micro_batch_mean_on_fsdp_cp_equals_its_micro_batches_on_one_process():
    """FSDP 2 × CP 2, two accumulation steps: each dp rank's micro-batch averaged over its own tokens
    (counted before CP cuts its sequences), the means averaged, equals one process running the same
    four micro-batches of two rows each (SGD, parameters compared); the global token mean on the
    same layout does not (the negative control: a check that can fail)."""
    ref = one_process_reference(split_micro_batches(BASE, 2))
    got, default = run_on_ranks(
        _option_and_default, 4, BASE, {"dp_shard_size": 2, "cp_size": 2}, timeout_s=400
    )[0]
    assert_matches(ref, got)
    assert_differs(ref, default)


@pytest.mark.parametrize("value", ["micro_batch_mean", "token_mean"])
def test_refused_before_launch(tmp_path, capsys, monkeypatch, value):
    """Under pipeline parallel with accumulation (one divisor for the joined micro-batches), and a
    value that is none of the two: one line naming the field and the fix, exit 2, no rank started."""
    from cli_helpers import forbid_launch, run_cli

    forbid_launch(monkeypatch)
    cfg = tmp_path / "c.yaml"
    cfg.write_text(
        f"base_model: tiny-llama\ntokenizer_vocab_size: 512\nsequence_len: 32\noutput_dir: {tmp_path / 'o'}\n"
        f"pipeline_parallel_size: 2\ngradient_accumulation_steps: 2\nloss_reduction: {value}\n"
    )
    code, _, err = run_cli(capsys, "train", cfg, "--dry-run")
    assert code == 2 and len(err.strip().splitlines()) == 1 and "loss_reduction" in err, err
    assert (
        "gradient_accumulation_steps: 1" if value == "micro_batch_mean" else "global_token_mean"
    ) in err, err
