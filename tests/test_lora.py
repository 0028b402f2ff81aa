"""LoRA (PEFT) trains the same adapter on every layout as on one process (fp32), and never touches
the base weights."""

import dataclasses

import peft  # noqa: F401  (imported once before the ranks fork)
import pytest
import torch

import faults
from ndparallel.models.presets import preset_config
from ndparallel.parallel.options import ActivationOptions, TPOptions
from ndparallel.testing import run_on_ranks
from ndparallel.tools.agreement import assert_differs, assert_matches, one_process_reference
from ndparallel.tools.equivalence import (
    TrainSetup,
    build_model,
    train_under_layout,
)

LORA = dict(r=4, alpha=8, dropout=0.0, target_linear=True)  # dropout 0: its RNG differs per layout
BASE = TrainSetup(
    preset_config("tiny-llama"),
    steps=3,
    global_micro_batch=4,
    seq_len=32,
    max_grad_norm=1.0,
    optimizer="sgd",
    lr=0.5,
    adapter=LORA,
)


def _initial_base(setup) -> dict[str, torch.Tensor]:
    model = build_model(setup)
    return {k: v.detach().clone() for k, v in model.state_dict().items() if ".lora_" not in k}


def _diffs(setup, layout, world):
    ref = one_process_reference(setup)
    got = run_on_ranks(train_under_layout, world, setup, layout, timeout_s=400)[0]
    moved = max(v.abs().max().item() for k, v in ref.result.params.items() if ".lora_B" in k)
    return ref, got, moved


def _check(layout, world, setup=BASE, **parallel_kwargs):
    setup = dataclasses.replace(setup, parallel_kwargs=parallel_kwargs)
    ref, got, moved = _diffs(setup, layout, world)
    assert moved > 1e-3, moved  # B starts at 0: training really moved the adapter
    # parameters (the adapters: the base is compared bit for bit below) under SGD only: AdamW
    # amplifies rounding, its losses and norms are the check
    assert_matches(ref, got, params=setup.optimizer == "sgd")
    base = _initial_base(setup)
    assert set(base) == {k for k in got.params if ".lora_" not in k}
    changed = [k for k, v in base.items() if not torch.equal(v, got.params[k])]
    assert changed == [], f"base weights changed: {changed[:3]}"  # bit for bit


def test_reference_trains_only_the_adapter():
    ref = one_process_reference(BASE).result
    assert ref.losses[-1] < ref.losses[0]
    base = _initial_base(BASE)
    assert all(torch.equal(v, ref.params[k]) for k, v in base.items())
    assert sum(".lora_A." in k for k in ref.params) == 2 * 7  # every linear of 2 layers, not lm_head


def test_fsdp2():
    _check({"dp_shard_size": 2}, 2)


def test_dp2():
    _check({"dp_replicate_size": 2}, 2)


def test_hsdp_2x2_with_activation_checkpointing():
    _check(
        {"dp_replicate_size": 2, "dp_shard_size": 2},
        4,
        activation_options=ActivationOptions(activation_checkpointing=True),
    )


def test_tp2():
    _check({"tp_size": 2}, 2)


def test_tp2_sequence_and_loss_parallel():
    _check({"tp_size": 2}, 2, tp_options=TPOptions(sequence_parallel=True, loss_parallel=True))


def test_cp2():
    _check({"cp_size": 2}, 2)


def test_fsdp2_tp2():
    _check({"dp_shard_size": 2, "tp_size": 2}, 4)


def test_fsdp2_tp2_adamw_with_accumulation():
    setup = dataclasses.replace(BASE, optimizer="adamw", lr=1e-2, grad_accum=2)
    _check({"dp_shard_size": 2, "tp_size": 2}, 4, setup=setup)


@pytest.mark.slow
def test_fsdp2_cp2_tp2_8_ranks():
    _check(
        {"dp_shard_size": 2, "cp_size": 2, "tp_size": 2},
        8,
        tp_options=TPOptions(sequence_parallel=True, loss_parallel=True),
    )


def test_a_broken_run_fails_the_check(monkeypatch):
    """Negative control: gradients never reduced over FSDP ranks give another adapter."""
    faults.skip_grad_sync(monkeypatch)
    ref, got, _ = _diffs(BASE, {"dp_shard_size": 2}, 2)
    assert_differs(ref, got)
