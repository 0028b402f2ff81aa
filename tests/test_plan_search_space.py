"""The search's pruning (``plan/search/bounds.py``) is exact: on small requests the pruned search
chooses, for every layout, the option the exhaustive one chooses (or rejects it for the same
reason), and each bound holds for every option the exhaustive search costs."""

from __future__ import annotations

import pytest

from ndparallel.plan.hardware import PRESETS as HW
from ndparallel.plan.memory.peak import resident_bytes
from ndparallel.plan.models import PRESETS
from ndparallel.plan.search import bounds, evaluation
from ndparallel.plan.search.evaluation import _ranks, evaluate_layout, plan
from ndparallel.plan.search.layouts import enumerate_layouts
from ndparallel.plan.search.request import PlanRequest

every = evaluate_layout

CASES = {
    "8B x 8 H100, seq 8192": ("llama-3.1-8b", "h100-80gb", 8, dict(sequence_len=8192)),
    "70B x 16 H100, pp": ("llama-3.1-70b", "h100-80gb", 16, dict(sequence_len=4096, global_batch_size=64)),
    "8B x 4 A100-40GB, seq 32768, host 16 GB": (
        "llama-3.1-8b",
        "a100-40gb",
        4,
        dict(sequence_len=32768, host_mem_bytes=16 * 2**30, global_batch_size=8),
    ),
    "3B x 8, LoRA": (
        "llama-3.2-3b",
        "a100-40gb",
        8,
        dict(sequence_len=8192, global_batch_size=32, lora_r=16),
    ),
    "3B x 8, unsharded accumulation": (
        "llama-3.2-3b",
        "a100-40gb",
        8,
        dict(sequence_len=8192, global_batch_size=64, unsharded_grad_accumulation=True),
    ),
}


def _request(name: str) -> PlanRequest:
    model, gpu, gpus, kw = CASES[name]
    return PlanRequest.of(PRESETS[model], HW[gpu], gpus, gpus_per_node=min(8, gpus), **kw)


def _layouts(req: PlanRequest):
    return enumerate_layouts(req.gpus, req.model.num_experts, req.model.layers)


@pytest.mark.parametrize("name", list(CASES))
def test_pruned_search_is_the_exhaustive_one(name):
    req = _request(name)
    searched = costed = 0
    for layout in _layouts(req):
        every = evaluate_layout(req, layout)
        pruned = evaluate_layout(req, layout, skip_unfit=True)
        assert pruned.ok == every.ok, layout
        if every.ok:
            assert pruned.best.settings == every.best.settings, layout
            assert pruned.best.tokens_per_s_per_gpu == every.best.tokens_per_s_per_gpu
        else:
            assert [c for c, _ in pruned.rejections] == [c for c, _ in every.rejections], layout
        searched, costed = searched + pruned.searched, costed + pruned.costed
    assert costed < searched  # the bounds prune something on each request


@pytest.mark.parametrize("name", [n for n in CASES if "70B" not in n] + ["70B x 16 H100, pp, some layouts"])
def test_bounds_hold_for_every_option(name):
    """Every option's tokens/s is at most its ``option_bound``, that at most its
    ``tokens_per_s_bound`` (the rank floors of both, which the settings the group varies — gradient
    reduction, resharding, offloading — leave unchanged), that at most its ``relaxed_bound`` (the
    step without checkpointing: whatever its policy, offloading and tiling), and its memory at
    least its resident bytes."""
    req = _request(name.removesuffix(", some layouts"))
    model, hw, g = req.model, req.hardware, req.gpus_per_node
    layouts = _layouts(req)
    if name.endswith("some layouts"):  # each pp degree with FSDP, and one without
        layouts = [lay for lay in layouts if lay.pp > 1 and (lay.fsdp == 2 or lay.dp == 1)]
        assert {lay.pp for lay in layouts} >= {2, 4, 8}
    checked = tighter = recomputed = 0
    for layout in layouts:
        for o in evaluate_layout(req, layout).options:
            s = o.settings
            bound = bounds.tokens_per_s_bound(model, layout, s, hw, g)
            relaxed = bounds.relaxed_bound(model, layout, s, hw, g)
            assert bound <= relaxed * (1 + bounds.ROUNDING), (layout, s)
            recomputed += s.activation_checkpointing and bound < relaxed
            plain = s.but(
                unsharded_grad_accumulation=False, reshard_after_forward=False, activation_offloading=False
            )
            assert bound == bounds.tokens_per_s_bound(model, layout, plain, hw, g)
            floors = bounds.rank_floors(model, layout, s, hw, g)
            assert floors == bounds.rank_floors(model, layout, plain, hw, g)
            own = bounds.option_bound(model, layout, s, hw, g)
            assert own == bounds.option_bound(model, layout, s, hw, g, floors) <= bound
            assert o.tokens_per_s_per_gpu <= own * (1 + bounds.ROUNDING), (layout, s)
            tighter += own < bound
            resident = max(resident_bytes(part, layout, rs, hw) for part, rs in _ranks(model, layout, s))
            assert resident <= o.memory.total, (layout, s)
            checked += 1
    assert checked > 100
    assert tighter > 0  # FSDP's exposure bounds some option tighter than its compute alone
    assert recomputed > 0  # recompute bounds some option tighter than the step without it


def test_8b_on_8_h100_at_8192_checkpoints_selectively_or_not_at_all():
    """Where the lighter policies fit, the best row uses one (issue 61): Llama-3.1-8B on 8 H100 at
    8,192 tokens."""
    req = PlanRequest.of(PRESETS["llama-3.1-8b"], HW["h100-80gb"], 8, gpus_per_node=8, sequence_len=8192)
    best = plan(req).ranked[0].best
    assert best.fits and best.settings.recompute in ("none", "selective"), best.settings


@pytest.mark.parametrize("top", [1, 3])
def test_top_search_is_the_full_one(top, monkeypatch):
    """``plan(top=k)``: the best k layouts, their settings and order, the count of those that fit
    and every rejection (code and message) of the full search; some layouts not evaluated, some
    evaluated only above the best ``top`` so far (``_TopSearch._above``), found below it or not."""
    evaluated = []
    above = []
    only_above = evaluation._TopSearch._above

    def counted(req, layout, **kw):
        evaluated.append(layout)
        return every(req, layout, **kw)

    def counted_above(search, i, floor):
        res = only_above(search, i, floor)
        evaluated.append(search.layouts[i])
        above.append(res is None)
        return res

    skipped = 0
    for name in CASES:
        req = _request(name)
        with monkeypatch.context() as m:
            m.setattr(evaluation, "evaluate_layout", counted)
            m.setattr(evaluation._TopSearch, "_above", counted_above)
            best = plan(req, top=top)
        full = plan(req)
        skipped += len(full.ranked) + len(full.rejected) - len(evaluated)
        evaluated.clear()
        assert best.fit_count == len(full.ranked), name
        assert [(r.layout, r.best.settings, r.best.tokens_per_s_per_gpu) for r in best.ranked] == [
            (r.layout, r.best.settings, r.best.tokens_per_s_per_gpu) for r in full.ranked[:top]
        ], name
        assert [(r.layout, r.rejections) for r in best.rejected] == [
            (r.layout, r.rejections) for r in full.rejected
        ], name
    assert skipped > 0
    assert set(above) == {True, False}


@pytest.mark.parametrize("name", list(CASES))
def test_a_fitting_lean_option_means_the_layout_fits(name):
    """Where ``_some_option_fits`` says yes (the device and, for the rank offloading the most,
    the host), ``evaluate_layout`` finds an option that fits: the table's search counts such a
    layout as fitting without evaluating it, and evaluates it only if it can reach the best."""
    req = _request(name)
    base = evaluation.base_settings(req)
    said = 0
    for layout in _layouts(req):
        if evaluation._layout_rejections(req, layout, base):
            continue
        specs = evaluation._specs(req, layout, base, False)
        if specs and evaluation._some_option_fits(req, layout, specs):
            said += 1
            assert evaluate_layout(req, layout, skip_unfit=True).ok, layout
    assert said > 0
