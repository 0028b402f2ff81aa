"""DP, FSDP, HSDP train the same model as one process (fp32), with every FSDP option."""

import dataclasses

import pytest

from layout_runs import LayoutRuns
from ndparallel.models.presets import preset_config
from ndparallel.parallel.options import ActivationOptions, FSDPOptions
from ndparallel.testing import run_on_ranks
from ndparallel.tools.agreement import (
    Reference,
    assert_differs,
    assert_matches,
    one_process_reference,
    stated_bounds,
)
from ndparallel.tools.equivalence import TrainSetup, train_under_layout

BASE = TrainSetup(preset_config("tiny-llama"), steps=3, global_micro_batch=4, seq_len=32)

LAYOUTS = {
    "dp2": ({"dp_replicate_size": 2}, 2),
    "fsdp2": ({"dp_shard_size": 2}, 2),
    "fsdp4": ({"dp_shard_size": 4}, 4),
    "hsdp2x2": ({"dp_replicate_size": 2, "dp_shard_size": 2}, 4),
}
VARIANTS = {
    "plain": {},
    "accum2": {"grad_accum": 2, "global_micro_batch": 4},
    "accum2_unsharded": {
        "grad_accum": 2,
        "parallel_kwargs": {"fsdp_options": FSDPOptions(unsharded_grad_accumulation=True)},
    },
    "ckpt": {"parallel_kwargs": {"activation_options": ActivationOptions(activation_checkpointing=True)}},
    "no_reshard": {"parallel_kwargs": {"fsdp_options": FSDPOptions(reshard_after_forward=False)}},
    "clip": {"max_grad_norm": 0.5},
}


# Every option on the 2- and 4-rank layouts; FSDP 4 (the slowest) with the plain variant.
CASES = [
    (layout, variant) for layout in LAYOUTS for variant in VARIANTS if layout != "fsdp4" or variant == "plain"
]
RUNS = {  # name -> (setup, layout, world): the runs of one layout share a rank group (tests/layout_runs.py)
    **{f"{lay}-{var}": (dataclasses.replace(BASE, **VARIANTS[var]), *LAYOUTS[lay]) for lay, var in CASES},
    "sgd": (dataclasses.replace(BASE, optimizer="sgd", lr=0.5), *LAYOUTS["hsdp2x2"]),
    "cpu_offload": (
        dataclasses.replace(BASE, parallel_kwargs={"fsdp_options": FSDPOptions(cpu_offload=True)}),
        *LAYOUTS["fsdp2"],
    ),
    "other_seed": (dataclasses.replace(BASE, seed=1), *LAYOUTS["fsdp2"]),
}


@pytest.fixture(scope="module")
def runs():
    return LayoutRuns(RUNS)


def _check(runs, name):
    setup = RUNS[name][0]
    # AdamW turns fp32 rounding on near-zero gradients into lr-sized parameter steps: its runs are
    # checked by losses and grad norms; parameters are compared under SGD (tools.agreement's bounds).
    return assert_matches(one_process_reference(setup), runs(name), params=setup.optimizer == "sgd")


@pytest.mark.parametrize("layout, variant", CASES)
def test_layout_equals_one_process(layout, variant, runs):
    _check(runs, f"{layout}-{variant}")


def test_sgd_parameters_match_tightly(runs):
    assert "param_abs" in _check(runs, "sgd")


def test_cpu_offload(runs):
    _check(runs, "cpu_offload")


@pytest.mark.parametrize(
    "layout, world",
    [
        ({"dp_shard_size": 2}, 2),
        ({}, 1),  # no data parallelism: bf16 still comes from FSDP2's policy, on a 1-rank mesh
        ({"tp_size": 2}, 2),
    ],
    ids=["fsdp2", "one_rank", "tp2"],
)
def test_bf16_runs_and_stays_close(layout, world):
    setup = dataclasses.replace(BASE, mixed_precision="bf16")
    ref = Reference(one_process_reference(BASE).result, stated_bounds(2e-2, "bf16 against fp32: stated"))
    got = run_on_ranks(train_under_layout, world, setup, layout)[0]
    assert_matches(ref, got, compared=("loss_rel",))


def test_the_check_can_fail(runs):
    """Negative control: a different seed must be detected as a mismatch."""
    assert_differs(one_process_reference(BASE), runs("other_seed"), params=False)


def _params_after_no_grad_forward():
    import torch
    from torch.distributed.tensor import DTensor
    from transformers import AutoModelForCausalLM

    from ndparallel import Accelerator, ParallelismConfig

    acc = Accelerator(ParallelismConfig(dp_shard_size=2))
    torch.manual_seed(0)
    model = acc.prepare(AutoModelForCausalLM.from_config(BASE.model_config))
    x = torch.randint(0, 256, (2, 16))
    with torch.no_grad():
        model(input_ids=x)
    params = dict(model.named_parameters())
    opt = torch.optim.SGD(params.values(), lr=0.5)  # built after an evaluation pass
    before = {n: p.detach().full_tensor().clone() for n, p in params.items()}
    acc.backward(model(input_ids=x, labels=x).loss)
    opt.step()
    return (
        {n: isinstance(p, DTensor) for n, p in params.items()},
        {n: float((p.detach().full_tensor() - before[n]).abs().max()) for n, p in params.items()},
    )


def test_no_grad_forward_leaves_parameters_sharded():
    """Regression: after an eval forward the root/output groups stayed gathered and an optimizer
    built then held temporary tensors, so lm_head and the final norm never trained."""
    is_dtensor, moved = run_on_ranks(_params_after_no_grad_forward, 2)[0]
    assert all(is_dtensor.values()), is_dtensor
    assert all(v > 0 for v in moved.values()), moved
