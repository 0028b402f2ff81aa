"""The search's memo keys are complete: each memoised function (``plan/memo.py``) reads only the
``Settings`` fields and layout degrees it is keyed on. Every other field is changed, one at a time,
and the function's answer (computed afresh) must not move; so must other layouts with the degrees
of its key. A field added to ``Settings`` without a value in ``_other`` fails here until someone
decides whether the memoised functions read it."""

from dataclasses import fields, replace

import pytest

from ndparallel.layout.dims import ParallelDims
from ndparallel.plan.hardware import PRESETS as HW
from ndparallel.plan.memo import Memo, clear_memos
from ndparallel.plan.memory import peak
from ndparallel.plan.models import PRESETS
from ndparallel.plan.search import bounds
from ndparallel.plan.search.estimate import exposure
from ndparallel.plan.settings import COLLECTIVE_FIELDS, Settings
from ndparallel.plan.time import comms, links
from ndparallel.plan.time.compute import MICRO_BATCH_FIELDS, STEP_DEFAULTS

_CHOICES = {
    "mixed_precision": ("bf16", "fp32"),
    "optimizer": ("adamw", "sgd"),
    "ac_policy": ("full", "selective"),
    "cp_comm_strategy": ("ring", "allgather"),
    "chunked_loss": (True, False),
    "cp_kernel": ("flash", "math"),
    "pipeline_schedule": ("1F1B", "Interleaved1F1B"),
}
_WHEN_NONE = {"loss_chunk_tokens": 1024, "tiled_mlp_num_shards": 4, "qat": "int4"}
DERIVED = {"recompute": ("activation_checkpointing", "ac_policy")}
"""Properties of ``Settings`` a key may name: the fields they cover."""


def _other(s: Settings, name: str):
    """A different valid value of field ``name``."""
    value = getattr(s, name)
    if name in _CHOICES:
        a, b = _CHOICES[name]
        return b if value == a else a
    if value is None:
        return _WHEN_NONE[name]
    if isinstance(value, bool):
        return not value
    if isinstance(value, int | float):
        return value * 2 + 1
    if isinstance(value, tuple):
        return () if value else ("embed",)
    raise AssertionError(f"Settings.{name}: no other value known to this test")


BASES = [
    Settings(sequence_len=4096, micro_batch_size=2, gradient_accumulation_steps=4, chunked_loss=True),
    Settings(
        sequence_len=8192,
        activation_checkpointing=True,
        sequence_parallel=False,
        cp_comm_strategy="allgather",
    ),
    Settings(
        sequence_len=2048,
        micro_batch_size=4,
        activation_checkpointing=True,
        ac_policy="selective",
        tiled_mlp=True,
    ),
]
MODELS = ["llama-3.1-8b", "qwen3-8b", "qwen3-30b-a3b"]


def _groups(model, layout, s, tokens, ga):
    """Each memoised collective group of ``comms.collectives_for``, computed afresh (``tokens`` and
    ``ga``: the micro-batch's tokens and accumulation steps, part of the key)."""
    return {
        "data_parallel": comms._data_parallel(model, layout, s),
        "tensor_parallel": comms._tensor_parallel(model, layout, s, tokens, ga),
        "context_parallel": comms._context_parallel(model, layout, s, tokens, ga),
    }


@pytest.mark.parametrize("name", sorted(COLLECTIVE_FIELDS))
@pytest.mark.parametrize("model_name", MODELS)
def test_collective_groups_read_only_their_key(name, model_name):
    model = PRESETS[model_name]
    layout = ParallelDims(dp_replicate=2, dp_shard=4, cp=2, tp=4, ep=4 if model.is_moe else 1)
    keyed = {f for k in COLLECTIVE_FIELDS[name] for f in DERIVED.get(k, (k,))}
    for s in BASES:
        key = (s.micro_batch_size * s.sequence_len // layout.cp, s.gradient_accumulation_steps)
        want = _groups(model, layout, s, *key)[name]
        for f in fields(Settings):
            if f.name not in keyed:
                changed = s.but(**{f.name: _other(s, f.name)})
                assert _groups(model, layout, changed, *key)[name] == want, (name, f.name)
    # the layout degrees outside the key: tensor parallel keys on tp, context parallel on cp and tp
    if name != "data_parallel":
        s, key = BASES[0], (4096, 4)
        want = _groups(model, layout, s, *key)[name]
        for other in (ParallelDims(dp_shard=16, cp=2, tp=4), ParallelDims(dp_replicate=4, cp=2, tp=4, pp=2)):
            assert _groups(model, other, s, *key)[name] == want


@pytest.mark.parametrize("model_name", MODELS[:2])
def test_micro_batch_terms_read_no_step_field(model_name):
    """``peak._micro_batch_terms`` is memoised on ``compute.micro_batch_key`` (every field but the
    step-level ones) and a dense model's (cp, tp)."""
    model = PRESETS[model_name]
    part = replace(model, layers=8, has_embedding=False)  # a pipeline rank's part
    assert set(STEP_DEFAULTS) | set(MICRO_BATCH_FIELDS) == {f.name for f in fields(Settings)}
    for m in (model, part):
        for s in BASES:
            layout = ParallelDims(dp_shard=4, cp=2, tp=4)
            want = peak._micro_batch_terms(m, layout, s)
            for name in STEP_DEFAULTS:
                assert peak._micro_batch_terms(m, layout, s.but(**{name: _other(s, name)})) == want, name
            for other in (
                ParallelDims(dp_replicate=8, cp=2, tp=4),
                ParallelDims(dp_shard=2, cp=2, tp=4, pp=4),
            ):
                assert peak._micro_batch_terms(m, other, s) == want


def test_memoised_estimates_equal_fresh_ones():
    """The same memory and collectives whether the memo tables are warm or emptied."""
    model, hw = PRESETS["llama-3.1-8b"], HW["h100-80gb"]
    layout, s = ParallelDims(dp_replicate=2, dp_shard=2, cp=2, tp=2), BASES[0]
    warm = (peak.estimate_memory(model, layout, s, hw), comms.collectives_for(model, layout, s))
    clear_memos()
    assert (peak.estimate_memory(model, layout, s, hw), comms.collectives_for(model, layout, s)) == warm


def test_memo_computes_once_and_stays_bounded():
    memo, calls = Memo(maxsize=2), []
    assert memo.get("a", lambda: calls.append("a") or 1) == 1
    assert memo.get("a", lambda: calls.append("again") or 2) == 1 and calls == ["a"]
    memo.get("b", lambda: 2)
    memo.get("c", lambda: 3)  # full: emptied first
    assert list(memo.table) == ["c"]


@pytest.mark.parametrize("model_name", MODELS)
def test_data_parallel_calls_read_only_the_precision(model_name):
    """``bounds.fsdp_traffic`` memoises each call's seconds (``comms.data_parallel_calls``) on the
    layout and ``mixed_precision``: no other field moves them, and the traffic it sums from them is
    the cost table's sum over ``comms.data_parallel``, to the bit, whatever the accumulation,
    resharding and synchronisation."""
    model, hw = PRESETS[model_name], HW["h100-80gb"]
    layout = ParallelDims(dp_replicate=2, dp_shard=4, cp=2, tp=4, ep=4 if model.is_moe else 1)
    costs = links.cost_table(layout, hw, 8)
    for s in BASES:
        want = comms.data_parallel_calls(model, layout, s)
        for f in fields(Settings):
            if f.name != "mixed_precision":
                assert comms.data_parallel_calls(model, layout, s.but(**{f.name: _other(s, f.name)})) == want
        for ga, uga, raf, rab, sync in [(1, False, True, True, False), (4, True, False, False, True)]:
            step = s.but(
                gradient_accumulation_steps=ga,
                unsharded_grad_accumulation=uga,
                reshard_after_forward=raf,
                reshard_after_backward=rab,
                sync_every_microbatch=sync,
            )
            sums = {"gather": 0.0, "reduce": 0.0}
            for c in comms._data_parallel(model, layout, step):
                sums[exposure(c)] += costs[c][0]
            assert bounds.fsdp_traffic(model, layout, step, hw, 8) == (sums["gather"], sums["reduce"])
