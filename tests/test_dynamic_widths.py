"""Micro-batches cut after their longest row (``pad_to_sequence_len: false``, Axolotl's default
without packing) train the same model as one process on every layout.

Real chat samples of 22–35 tokens in rows of 64, one per row, read through the trainer's loader:
the one process cuts each global micro-batch after its longest row; under a layout every dp rank
cuts its own rows (so the dp ranks of one step compute different widths), rounded up to what the
layout needs (8; 2·cp under CP; cp·tp under TP + sequence parallel), and under pipeline parallel
also bucketed (the stages exchange fixed shapes: one set of stage buffers per width,
``parallel/pp/schedule.py``). Losses, gradient norms and the parameters after SGD must equal one
process's under the one rule (``tools/agreement.py``)."""

from __future__ import annotations

import dataclasses

import pytest

from ndparallel.data.prepare import DataOptions, build_data
from ndparallel.models.presets import preset_config
from ndparallel.parallel.options import PipelineOptions, TPOptions
from ndparallel.testing import run_on_ranks
from ndparallel.tools.agreement import assert_matches, one_process_reference
from ndparallel.tools.equivalence import TrainSetup, rows_loader, train_under_layout
from sft_fixtures import chat_records, llama3_tokenizer, write_jsonl

SEQ, ROWS, STEPS = 64, 4, 3
_cache: dict = {}


def _setup(tmp_path_factory) -> TrainSetup:
    if "setup" not in _cache:
        tok = llama3_tokenizer()
        one_exchange = [{"messages": r["messages"][-2:]} for r in chat_records(40, seed=3)]
        data = write_jsonl(tmp_path_factory.mktemp("widths") / "chat.jsonl", one_exchange)
        rows = build_data(
            [{"path": str(data), "type": "chat_template"}], tok, DataOptions(sequence_len=SEQ)
        ).train
        config = preset_config("tiny-llama", vocab_size=len(tok))
        config.use_cache = False
        _cache["setup"] = TrainSetup(
            config,
            steps=STEPS,
            global_micro_batch=ROWS,
            grad_accum=2,
            seq_len=SEQ,
            optimizer="sgd",
            weight_decay=0.0,
            lr=1e-1,
            max_grad_norm=1.0,
            rows=rows,
        )
    return _cache["setup"]


def test_the_ranks_cut_different_widths(tmp_path_factory):
    """What the layouts below compute: dp ranks of one step, and the steps, differ in width; the
    one process computes each global micro-batch at its longest row's (rounded) width."""
    setup = _setup(tmp_path_factory)
    one = rows_loader(setup, 1, 0, 1)
    ranks = [rows_loader(setup, 2, r, 2) for r in (0, 1)]
    widths = [[ld.micro_batch(i)["input_ids"].shape[1] for ld in ranks] for i in range(2 * STEPS)]
    assert any(a != b for a, b in widths) and len({w for pair in widths for w in pair}) > 1, widths
    for i, pair in enumerate(widths):
        assert one.micro_batch(i)["input_ids"].shape[1] == max(pair) < SEQ
    bucketed = rows_loader(dataclasses.replace(setup, bucketed=True), 1, 0, 1)
    assert {bucketed.micro_batch(i)["input_ids"].shape[1] for i in range(2 * STEPS)} <= {8, 16, 32, 64}


PP_STEP = {"grad_accum": 1, "bucketed": True}
"""Pipeline parallel: one micro-batch per step (split into 2 pipeline micro-batches), so the steps'
widths differ (the trainer buckets them there)."""
LAYOUTS = {
    "fsdp2-tp2-sp": (
        {"dp_shard_size": 2, "tp_size": 2},
        {"tp_options": TPOptions(sequence_parallel=True)},
        4,
    ),
    "cp2": ({"cp_size": 2}, {}, 2),
    "pp2": ({"pp_size": 2}, {"pipeline_options": PipelineOptions(microbatches=2)}, 2),
}


def test_pipeline_steps_change_width(tmp_path_factory):
    setup = dataclasses.replace(_setup(tmp_path_factory), **PP_STEP)
    one = rows_loader(setup, 1, 0, 1)
    assert len({one.micro_batch(i)["input_ids"].shape[1] for i in range(STEPS)}) > 1


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_cut_widths_equal_one_process(tmp_path_factory, name):
    layout, options, world = LAYOUTS[name]
    setup = dataclasses.replace(
        _setup(tmp_path_factory), parallel_kwargs=options, **(PP_STEP if name == "pp2" else {})
    )
    got = run_on_ranks(train_under_layout, world, setup, layout, timeout_s=400)[0]
    assert_matches(one_process_reference(setup), got)
