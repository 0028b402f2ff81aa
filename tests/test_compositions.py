"""Compositions of strategies on one mesh train the same model as one process (fp32)."""

import dataclasses

import pytest

from layout_runs import LayoutRuns
from ndparallel.models.presets import preset_config
from ndparallel.parallel.options import CPOptions, TPOptions
from ndparallel.tools.agreement import assert_matches, one_process_reference
from ndparallel.tools.equivalence import TrainSetup

BASE = TrainSetup(preset_config("tiny-llama"), steps=3, global_micro_batch=4, seq_len=32, max_grad_norm=1.0)


def _setup(optimizer="adamw", **parallel_kwargs) -> TrainSetup:
    lr = 0.5 if optimizer == "sgd" else BASE.lr
    return dataclasses.replace(BASE, parallel_kwargs=parallel_kwargs, optimizer=optimizer, lr=lr)


FSDP2_CP2 = ({"dp_shard_size": 2, "cp_size": 2}, 4)
FSDP2_TP2 = ({"dp_shard_size": 2, "tp_size": 2}, 4)
TP2_CP2 = ({"tp_size": 2, "cp_size": 2}, 4)
SP_LP = TPOptions(sequence_parallel=True, loss_parallel=True)
RUNS = {  # name -> (setup, layout, world): the runs of one layout share a rank group (tests/layout_runs.py)
    **{
        f"fsdp2_cp2_{s}": (_setup("sgd", cp_options=CPOptions(comm_strategy=s)), *FSDP2_CP2)
        for s in ("ring", "allgather", "ulysses")
    },
    "fsdp2_cp2_sgd": (_setup("sgd"), *FSDP2_CP2),
    "fsdp2_cp2_accumulation": (dataclasses.replace(BASE, grad_accum=2), *FSDP2_CP2),
    "hsdp_cp2": (_setup(), {"dp_replicate_size": 2, "cp_size": 2}, 4),
    "fsdp2_tp2_sgd": (_setup("sgd"), *FSDP2_TP2),
    "fsdp2_tp2": (_setup(), *FSDP2_TP2),
    "fsdp2_tp2_sp_lp": (_setup(tp_options=SP_LP), *FSDP2_TP2),
    **{
        f"tp2_cp2_{s}": (_setup(cp_options=CPOptions(comm_strategy=s)), *TP2_CP2) for s in ("ring", "ulysses")
    },
    "hsdp2x2_tp2": (_setup(), {"dp_replicate_size": 2, "dp_shard_size": 2, "tp_size": 2}, 8),
    **{
        f"fsdp2_cp2_tp2_{s}": (
            _setup(tp_options=SP_LP, cp_options=CPOptions(comm_strategy=s)),
            {"dp_shard_size": 2, "cp_size": 2, "tp_size": 2},
            8,
        )
        for s in ("ring", "ulysses")
    },
    "full_4d": (_setup(), {"dp_replicate_size": 2, "dp_shard_size": 2, "cp_size": 2, "tp_size": 2}, 16),
}


@pytest.fixture(scope="module")
def runs():
    return LayoutRuns(RUNS)


def _check(runs, name):
    setup = RUNS[name][0]
    # SGD keeps parameters within fp32 rounding. AdamW divides by sqrt(v) and so turns rounding noise
    # on near-zero gradients into lr-sized steps (1.5e-3 seen once on a loaded clean clone): its
    # parameters are not compared, the losses and grad norms are its tight check.
    assert_matches(one_process_reference(setup), runs(name), params=setup.optimizer == "sgd")


@pytest.mark.parametrize("strategy", ["ring", "allgather", "ulysses"])
def test_fsdp2_cp2(strategy, runs):
    _check(runs, f"fsdp2_cp2_{strategy}")


def test_hsdp_cp2(runs):
    _check(runs, "hsdp_cp2")


def test_fsdp2_cp2_sgd_parameters(runs):
    _check(runs, "fsdp2_cp2_sgd")


def test_fsdp2_tp2_sgd_parameters(runs):
    _check(runs, "fsdp2_tp2_sgd")


def test_cp_with_gradient_accumulation(runs):
    name = "fsdp2_cp2_accumulation"
    # the losses, as this test always compared: AdamW turns rounding on near-zero gradients into
    # lr-sized steps, which moved step 3's grad norm 3.5x past the rounding bound here (2026-12-06)
    assert_matches(one_process_reference(RUNS[name][0]), runs(name), compared=("loss_rel",))


@pytest.mark.parametrize("strategy", ["ring", "ulysses"])
def test_tp2_cp2(strategy, runs):
    _check(runs, f"tp2_cp2_{strategy}")


def test_fsdp2_tp2(runs):
    _check(runs, "fsdp2_tp2")


def test_fsdp2_tp2_sequence_and_loss_parallel(runs):
    _check(runs, "fsdp2_tp2_sp_lp")


@pytest.mark.slow
def test_hsdp2x2_tp2_8_ranks(runs):
    _check(runs, "hsdp2x2_tp2")


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ring", "ulysses"])
def test_fsdp2_cp2_tp2_8_ranks(strategy, runs):
    _check(runs, f"fsdp2_cp2_tp2_{strategy}")


@pytest.mark.slow
def test_full_4d_16_ranks(runs):
    _check(runs, "full_4d")
