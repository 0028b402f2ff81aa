"""Packed fine-tuning rows train exactly as their samples trained one by one.

Real chat samples (Llama 3 template, prompts masked) are packed by ``sample_packing`` into rows of
64 tokens. The reference trains every sample of every row as its own sequence on one process
(positions from 0, no mask needed, padding left out), with the same global token count and
optimizer. The packed rows must give the same per-step losses and global gradient norms (fp32,
relative 1e-5) on one process, under FSDP × TP and under FSDP × CP × TP (document masking, #15).
Negative control: the same rows with position_ids that do not restart (attention crossing
samples) must differ.
"""

import dataclasses

import pytest
import torch

from ndparallel.data import epoch_permutation
from ndparallel.data.prepare import DataOptions, build_data
from ndparallel.models.presets import preset_config
from ndparallel.techniques.loss import IGNORE_INDEX
from ndparallel.testing import run_on_ranks
from ndparallel.tools.agreement import assert_differs, assert_matches, one_process_reference
from ndparallel.tools.equivalence import (
    TrainResult,
    TrainSetup,
    build_model,
    full_parameters,
    setup_optimizer,
    train_under_layout,
)
from sft_fixtures import chat_records, llama3_tokenizer, write_jsonl

SEQ, ROWS, STEPS = 64, 4, 2
_cache: dict = {}


def _setup(tmp_path_factory) -> TrainSetup:
    if "setup" not in _cache:
        tok = llama3_tokenizer()
        one_exchange = [{"messages": r["messages"][-2:]} for r in chat_records(40, seed=3)]
        data = write_jsonl(tmp_path_factory.mktemp("sft") / "chat.jsonl", one_exchange)
        rows = build_data(
            [{"path": str(data), "type": "chat_template"}],
            tok,
            DataOptions(sequence_len=SEQ, sample_packing=True),
        ).train
        order = epoch_permutation(len(rows), seed=0, epoch=0)  # the loader's order
        batches, lengths = [], []
        for step in range(STEPS):
            idx = order[step * ROWS : (step + 1) * ROWS]
            batches.append([rows[idx]])
            lengths.append(rows.lengths(idx.numpy()).tolist())
        config = preset_config("tiny-llama", vocab_size=len(tok))
        config.use_cache = False
        _cache["setup"] = TrainSetup(
            config,
            steps=STEPS,
            global_micro_batch=ROWS,
            seq_len=SEQ,
            lr=1e-2,
            max_grad_norm=1.0,
            batches=batches,
        )
        _cache["lengths"] = lengths
    return _cache["setup"]


def _sample_spans(position_ids: torch.Tensor, length: int) -> list[tuple[int, int]]:
    starts = [0] + [i for i in range(1, length) if int(position_ids[i]) == 0]
    return list(zip(starts, [*starts[1:], length]))


def train_samples_separately(setup: TrainSetup, lengths: list[list[int]]) -> TrainResult:
    """One process: each sample of each row alone, padding left out."""
    from ndparallel.techniques.loss import causal_lm_loss

    model = build_model(setup)
    optimizer = setup_optimizer(setup, model.parameters())
    model.train()
    losses, norms = [], []
    for step, micro_batches in enumerate(setup.batches):
        n_items = int(sum((mb["shift_labels"] != IGNORE_INDEX).sum() for mb in micro_batches))
        step_loss = 0.0
        for mb in micro_batches:
            for row in range(mb["input_ids"].shape[0]):
                for a, b in _sample_spans(mb["position_ids"][row], lengths[step][row]):
                    logits = model(
                        input_ids=mb["input_ids"][row : row + 1, a:b],
                        position_ids=torch.arange(b - a).unsqueeze(0),
                    ).logits
                    loss = causal_lm_loss(logits, mb["shift_labels"][row : row + 1, a:b], n_items)
                    loss.backward()
                    step_loss += float(loss.detach())
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), setup.max_grad_norm)))
        optimizer.step()
        optimizer.zero_grad()
        losses.append(step_loss)
    return TrainResult(losses, norms, full_parameters(model))


def _reference(setup):
    """Each sample alone, held to the bounds of the packed one-process run's noise floor."""
    import functools

    return one_process_reference(
        setup, train=functools.partial(train_samples_separately, lengths=_cache["lengths"])
    )


def test_rows_pack_several_samples(tmp_path_factory):
    setup = _setup(tmp_path_factory)
    restarts = sum(int((mb["position_ids"][:, 1:] == 0).sum()) for step in setup.batches for mb in step)
    assert restarts >= STEPS * ROWS  # more than one sample per row on average
    trained = sum(int((mb["shift_labels"] != IGNORE_INDEX).sum()) for step in setup.batches for mb in step)
    tokens = sum(mb["input_ids"].numel() for step in setup.batches for mb in step)
    assert 0 < trained < tokens / 2  # prompts masked


@pytest.mark.parametrize(
    "layout, world", [(None, 1), ({"dp_shard_size": 2, "tp_size": 2}, 4)], ids=["one-process", "fsdp2-tp2"]
)
def test_packed_rows_equal_samples_trained_separately(tmp_path_factory, layout, world):
    setup = _setup(tmp_path_factory)
    got = run_on_ranks(train_under_layout, world, setup, layout, timeout_s=400)[0]
    assert_matches(_reference(setup), got, params=False)  # AdamW: losses and grad norms


@pytest.mark.slow
def test_packed_rows_equal_samples_trained_separately_fsdp_cp_tp(tmp_path_factory):
    setup = _setup(tmp_path_factory)
    got = run_on_ranks(
        train_under_layout, 8, setup, {"dp_shard_size": 2, "cp_size": 2, "tp_size": 2}, timeout_s=600
    )[0]
    assert_matches(_reference(setup), got, params=False)  # AdamW: losses and grad norms


def test_negative_control_attention_across_samples(tmp_path_factory):
    """The same rows with position_ids 0..63 (no restart): attention crosses samples, results differ."""
    setup = dataclasses.replace(_setup(tmp_path_factory), fault="cross-documents")
    got = run_on_ranks(train_under_layout, 1, setup, None)[0]
    assert_differs(_reference(setup), got, params=False)
