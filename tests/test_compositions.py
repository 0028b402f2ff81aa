"""Compositions of strategies on one mesh train the same model as one process (fp32)."""

import dataclasses

import pytest

from ndparallel.models.presets import preset_config
from ndparallel.parallel.options import CPOptions, TPOptions
from ndparallel.testing import run_on_ranks
from ndparallel.tools.agreement import assert_matches, one_process_reference
from ndparallel.tools.equivalence import TrainSetup, train_under_layout

BASE = TrainSetup(preset_config("tiny-llama"), steps=3, global_micro_batch=4, seq_len=32, max_grad_norm=1.0)


def _check(layout, world, optimizer="adamw", **parallel_kwargs):
    setup = dataclasses.replace(
        BASE, parallel_kwargs=parallel_kwargs, optimizer=optimizer, lr=0.5 if optimizer == "sgd" else BASE.lr
    )
    got = run_on_ranks(train_under_layout, world, setup, layout, timeout_s=400)[0]
    # SGD keeps parameters within fp32 rounding. AdamW divides by sqrt(v) and so turns rounding noise
    # on near-zero gradients into lr-sized steps (1.5e-3 seen once on a loaded clean clone): its
    # parameters are not compared, the losses and grad norms are its tight check.
    assert_matches(one_process_reference(setup), got, params=optimizer == "sgd")


@pytest.mark.parametrize("strategy", ["ring", "allgather", "ulysses"])
def test_fsdp2_cp2(strategy):
    _check(
        {"dp_shard_size": 2, "cp_size": 2}, 4, optimizer="sgd", cp_options=CPOptions(comm_strategy=strategy)
    )


def test_hsdp_cp2():
    _check({"dp_replicate_size": 2, "cp_size": 2}, 4)


def test_fsdp2_cp2_sgd_parameters():
    _check({"dp_shard_size": 2, "cp_size": 2}, 4, optimizer="sgd")


def test_fsdp2_tp2_sgd_parameters():
    _check({"dp_shard_size": 2, "tp_size": 2}, 4, optimizer="sgd")


def test_cp_with_gradient_accumulation():
    setup = dataclasses.replace(BASE, grad_accum=2)
    got = run_on_ranks(train_under_layout, 4, setup, {"dp_shard_size": 2, "cp_size": 2})[0]
    # the losses, as this test always compared: AdamW turns rounding on near-zero gradients into
    # lr-sized steps, which moved step 3's grad norm 3.5x past the rounding bound here (2026-12-06)
    assert_matches(one_process_reference(setup), got, compared=("loss_rel",))


@pytest.mark.parametrize("strategy", ["ring", "ulysses"])
def test_tp2_cp2(strategy):
    _check({"tp_size": 2, "cp_size": 2}, 4, cp_options=CPOptions(comm_strategy=strategy))


def test_fsdp2_tp2():
    _check({"dp_shard_size": 2, "tp_size": 2}, 4)


def test_fsdp2_tp2_sequence_and_loss_parallel():
    _check(
        {"dp_shard_size": 2, "tp_size": 2},
        4,
        tp_options=TPOptions(sequence_parallel=True, loss_parallel=True),
    )


@pytest.mark.slow
def test_hsdp2x2_tp2_8_ranks():
    _check({"dp_replicate_size": 2, "dp_shard_size": 2, "tp_size": 2}, 8)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ring", "ulysses"])
def test_fsdp2_cp2_tp2_8_ranks(strategy):
    _check(
        {"dp_shard_size": 2, "cp_size": 2, "tp_size": 2},
        8,
        tp_options=TPOptions(sequence_parallel=True, loss_parallel=True),
        cp_options=CPOptions(comm_strategy=strategy),
    )


@pytest.mark.slow
def test_full_4d_16_ranks():
    _check({"dp_replicate_size": 2, "dp_shard_size": 2, "cp_size": 2, "tp_size": 2}, 16)
