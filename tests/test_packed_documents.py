"""Packed rows train exactly as their documents trained separately, on every layout.

Rows hold several documents (position_ids restart at 0 at each document start, the label across
each boundary is -100). The reference runs every document as its own sequence on one process
(``train_documents_separately``): no mask involved. The packed run must give the same losses and
global gradient norms (fp32, ``tools.agreement``'s bounds) on one process (transformers' own packed-sequence
mask), with ndparallel's one-device document attention, and under CP 2 / CP 4 / FSDP×CP / TP×CP
for the ring, all-gather and all-to-all strategies.
"""

import dataclasses

import pytest

from ndparallel.models.presets import preset_config
from ndparallel.parallel.options import CPOptions
from ndparallel.testing import run_on_ranks
from ndparallel.tools.agreement import assert_differs, assert_matches, one_process_reference
from ndparallel.tools.equivalence import (
    TrainSetup,
    make_global_batches,
    train_documents_separately,
    train_under_layout,
)

SETUP = TrainSetup(
    preset_config("tiny-llama"),
    steps=2,
    global_micro_batch=4,
    seq_len=32,
    max_grad_norm=1.0,
    packed_documents=True,
)


def _reference():
    """Every document as its own sequence (no mask), held to the bounds of SETUP's noise floor."""
    return one_process_reference(SETUP, train=train_documents_separately)


def _check(layout, world, setup=SETUP):
    got = run_on_ranks(train_under_layout, world, setup, layout, timeout_s=400)[0]
    return assert_matches(_reference(), got, compared=("loss_rel", "grad_norm_rel"))


def test_batches_are_packed():
    rows = [mb["position_ids"] for step in make_global_batches(SETUP) for mb in step]
    restarts = sum(int((p[:, 1:] == 0).sum()) for p in rows)
    assert restarts >= 8, "the test data must contain document starts inside rows"


def test_one_process_transformers_mask():
    _check(None, 1)


def _one_device_document_attention(setup):
    """One process with ndparallel's document attention (apply_document_attention) instead of
    transformers' sdpa mask: the model is built, switched, then trained as train_under_layout."""
    from ndparallel.parallel import document_attention
    from ndparallel.tools import equivalence

    build = equivalence.build_model
    equivalence.build_model = lambda s: document_attention.apply_document_attention(build(s))
    try:
        return equivalence.train_under_layout(setup, None)
    finally:
        equivalence.build_model = build


def test_one_process_document_attention():
    got = run_on_ranks(_one_device_document_attention, 1, SETUP)[0]
    assert_matches(_reference(), got, compared=("loss_rel", "grad_norm_rel"))


def test_negative_control_attention_across_documents():
    """Same packed data, but the model attends across document starts: must not match."""
    broken = dataclasses.replace(SETUP, fault="cross-documents")
    assert_differs(
        _reference(), run_on_ranks(train_under_layout, 2, broken, {"cp_size": 2}, timeout_s=400)[0]
    )


STRATEGIES = ["ring", "allgather", "ulysses"]


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("cp", [2, 4])
def test_cp(strategy, cp):
    setup = dataclasses.replace(SETUP, parallel_kwargs={"cp_options": CPOptions(comm_strategy=strategy)})
    _check({"cp_size": cp}, cp, setup)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_fsdp2_cp2(strategy):
    setup = dataclasses.replace(SETUP, parallel_kwargs={"cp_options": CPOptions(comm_strategy=strategy)})
    _check({"dp_shard_size": 2, "cp_size": 2}, 4, setup)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_tp2_cp2(strategy):
    setup = dataclasses.replace(SETUP, parallel_kwargs={"cp_options": CPOptions(comm_strategy=strategy)})
    _check({"tp_size": 2, "cp_size": 2}, 4, setup)


def test_tp2_no_cp():
    _check({"tp_size": 2}, 2)
