"""The one rule for "a layout trains the same model as one process" (tests and ``ndparallel verify``).

A bound is never a constant tuned on one CPU. For every quantity compared (loss, gradient norm,
router loss: relative, per step; parameters after training: absolute) it is

    family × max(NOISE_SAFETY × noise, floor)

- ``noise``: the one-process reference trained a second way that is exact in real arithmetic — the
  rows of every micro-batch in reverse order, so every sum over tokens (weight gradients, the loss)
  runs in another order — and its own difference from the first. That is the rounding the machine's
  kernels (MKL's AVX2 / AVX-512 paths, ATen's vector width) put into this very setup. Under fp16
  compute also the rows as two accumulated micro-batches (``split_micro_batches``), the larger
  difference counting: fp16 rounds each micro-batch's (and each rank's) partial weight gradients
  before the fp32 sum, which reversed rows do not move on every kernel path (ATen's unvectorised
  one: 10x less, 2026-12-06).
- ``NOISE_SAFETY`` (8): a layout reorders more sums than the second way does (shards of every
  matmul, CP's blockwise softmax, one all-reduce per mesh dimension); their rounding adds up with
  random signs, so a few times the measured noise covers it (bench/reference/equivalence_headroom.md).
- ``family``: sqrt(head_dim) for unit-scaled QK-norm attention (``UNIT_SCALED_QK_NORM``): a layout
  that reorders the attention logits' sums (CP, TP's heads) is amplified sqrt(head_dim) times more
  than by 1/sqrt(d) attention, which the second way (same attention per row) does not exercise
  (tests/test_rounding_bounds.py, docs/families.md); it scales the floor too.
- ``floor``: log2(n) fp32 roundings per step, n the parameter count (× the parameters' largest
  magnitude for the absolute parameter difference): the gradient norm sums n squares and every
  global quantity comes from sums that large; such a sum taken in another order may differ by up
  to log2(n) ulp (pairwise summation's bound), so below that no two fp32 runs can be told apart,
  whatever the noise measurement happened to give (it is often 0 on tiny models).

Fake quantisation (QAT, float8) is discontinuous: once weights differ by a rounding, a value on a
level boundary rounds the other way in one run. Such runs keep the rule while the quantiser sees the
same weights (step 1) and are held to twice the quantiser's own effect after (``quantiser_bounds``).

A real layout bug (a skipped gradient sync, a wrong document mask, a misrouted expert) moves the
results by 1e-3 or more: orders of magnitude above every bound (bench/reference/equivalence_headroom.md).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass

from ndparallel.runtime.multirank import run_on_ranks
from ndparallel.tools import equivalence
from ndparallel.tools.equivalence import (
    TrainResult,
    TrainSetup,
    compare,
    make_global_batches,
    train_under_layout,
)

NOISE_SAFETY = 8.0
FP32_EPS = 2.0**-23
UNIT_SCALED_QK_NORM = ("gemma4_text",)
"""Families whose attention multiplies RMS-normalised q and k with scaling 1 (not 1/sqrt(head_dim))."""
RATIOS_ENV = "NDPARALLEL_EQUIVALENCE_RATIOS"
"""When set, a file every ``verdict`` appends one JSON line to (the test, each quantity's
difference / bound): ``tests/tools/kernel_paths.py`` reads the largest."""
QUANTITIES = {
    "loss_rel": "loss",
    "grad_norm_rel": "grad norm",
    "aux_rel": "aux loss",
    "param_abs": "parameters",
}


def family_factor(config) -> tuple[float, str]:
    """sqrt(head_dim) (the largest of its layers) for unit-scaled QK-norm attention, else 1."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if getattr(text, "model_type", None) not in UNIT_SCALED_QK_NORM:
        return 1.0, ""
    head_dim = max(layer.head_dim for layer in text.per_layer_config)
    return head_dim**0.5, f"sqrt(head_dim {head_dim}): unit-scaled QK-norm attention"


def reversed_rows(setup: TrainSetup) -> TrainSetup:
    """The same training, every micro-batch's rows in reverse order: equal in real arithmetic."""
    batches = [[{k: v.flip(0) for k, v in mb.items()} for mb in step] for step in make_global_batches(setup)]
    return dataclasses.replace(setup, batches=batches)


def split_micro_batches(setup: TrainSetup, parts: int = 2) -> TrainSetup:
    """The same training, every micro-batch's rows as ``parts`` accumulated micro-batches: equal in
    real arithmetic (the loss is normalised over the whole step's tokens either way); under
    ``loss_reduction: micro_batch_mean``, the micro-batches of ``parts`` dp ranks on one process."""
    rows = setup.global_micro_batch // parts
    batches = [
        [{k: v[i * rows : (i + 1) * rows] for k, v in mb.items()} for mb in step for i in range(parts)]
        for step in make_global_batches(setup)
    ]
    return dataclasses.replace(
        setup, batches=batches, grad_accum=setup.grad_accum * parts, global_micro_batch=rows
    )


def second_ways(setup: TrainSetup) -> list[TrainSetup]:
    """The trainings ``setup``'s reference is also run as to measure its noise (module docstring)."""
    ways = [reversed_rows(setup)]
    splits = setup.global_micro_batch % 2 == 0 and setup.loss_reduction == "global_token_mean"
    if setup.mixed_precision == "fp16" and splits:
        ways.append(split_micro_batches(setup))
    return ways


@dataclass(frozen=True)
class Bounds:
    """The largest difference from one process each quantity may show, and where it comes from."""

    limits: dict[str, float]
    sources: dict[str, str]

    def describe(self, key: str) -> str:
        return f"{self.limits[key]:.1e} ({self.sources[key]})"


def fp32_floor(n: int, steps: int) -> float:
    """The rule's relative floor: ``log2(n)`` fp32 ulp per step (a sum of ``n`` terms in another
    order may differ by up to log2(n) ulp: pairwise summation's bound)."""
    return math.log2(n) * FP32_EPS * steps


def model_floor(model_config, steps: int) -> float:
    """``fp32_floor`` of a model built from ``model_config`` (its parameter count): the bound of
    loops that have no second way (hand-written training loops, resumes on another layout)."""
    key = model_config.to_json_string()
    if key not in _PARAMETER_COUNTS:
        model = equivalence.build_model(TrainSetup(model_config))
        _PARAMETER_COUNTS[key] = sum(p.numel() for p in model.parameters())
    return fp32_floor(_PARAMETER_COUNTS[key], steps)


_PARAMETER_COUNTS: dict[str, int] = {}
"""Parameter counts by model config (a cache: building a model to count is not free)."""


def measured_bounds(
    setup: TrainSetup, first: TrainResult, *seconds: TrainResult, n_params: int | None = None
) -> Bounds:
    """The rule above from the reference (``first``) and its second ways (``seconds``: the largest
    difference of each quantity counts). ``n_params``: the model's parameter count where the results
    carry no parameters (a peer's runs, recorded as a fixture)."""
    diffs = [compare(first, second) for second in seconds]
    noise = {k: max(d[k] for d in diffs) for k in QUANTITIES if all(k in d for d in diffs)}
    factor, why = family_factor(setup.model_config)
    steps = max(len(first.losses), 1)
    n = n_params or sum(p.numel() for p in (first.params or {}).values()) or 2
    rel_floor = fp32_floor(n, steps)
    scale = _largest_finite(first.params or {})
    limits, sources = {}, {}
    family = f" × {factor:.1f} ({why})" if factor > 1 else ""
    for key in QUANTITIES:
        if key not in noise:
            continue
        floor = rel_floor * (scale if key == "param_abs" else 1.0)
        derived = NOISE_SAFETY * noise[key]
        limits[key] = max(derived, floor) * factor
        sources[key] = (
            f"noise floor {noise[key]:.1e} × {NOISE_SAFETY:g}"
            if derived >= floor
            else f"fp32 floor log2({n}) ulp × {steps} steps"
            + (f" × |p| {scale:.2g}" if key == "param_abs" else "")
        ) + family
    return Bounds(limits, sources)


def stated_bounds(rel: float, why: str, param_abs: float | None = None) -> Bounds:
    """Bounds stated with a reason instead of measured (low-precision runs: bf16 against fp32)."""
    limits = {"loss_rel": rel, "grad_norm_rel": rel, "aux_rel": rel}
    if param_abs is not None:
        limits["param_abs"] = param_abs
    return Bounds(limits, dict.fromkeys(limits, why))


@dataclass(frozen=True)
class Reference:
    """A one-process run and the bounds a layout's run is held to against it."""

    result: TrainResult
    bounds: Bounds


@dataclass(frozen=True)
class Verdict:
    ok: bool
    diff: dict
    ratios: dict[str, float]  # difference / bound per quantity
    worst: str  # the quantity closest to (or furthest over) its bound
    bounds: Bounds

    def line(self) -> str:
        """One line: the largest difference against its bound and the bound's source."""
        k = self.worst
        return (
            f"{QUANTITIES[k]} {self.diff[k]:.1e} is {self.ratios[k]:.2g} of its bound "
            f"{self.bounds.describe(k)}"
        )


def reference_runs(setup: TrainSetup) -> list[TrainResult]:
    """Inside one rank: the one-process run and its second ways (``second_ways``)."""
    one = dataclasses.replace(setup, fault=None)
    return [train_under_layout(s, None) for s in (one, *second_ways(one))]


def reference_in_rank(setup: TrainSetup, train=None) -> Reference:
    """Inside one rank: the reference with its measured bounds. ``train(setup) -> TrainResult``:
    another one-process reference of the same training (e.g. every document as its own sequence),
    held to the bounds measured on ``setup``'s own two ways."""
    first, *seconds = reference_runs(setup)
    return Reference(train(setup) if train is not None else first, measured_bounds(setup, first, *seconds))


def verdict(
    ref: Reference,
    got: TrainResult,
    *,
    params: bool = True,
    compared: tuple = (),
    expect_equal: bool | None = True,
) -> Verdict:
    """Compare ``got`` with the reference under its bounds; ``params=False`` leaves the parameters
    out (AdamW: its sqrt(v) turns rounding on near-zero gradients into lr-sized steps). With
    ``compared``, only those quantities decide. ``expect_equal`` labels the recorded ratios: True
    for an equal-to-one-process check, False for a fault, None for a decision whose caller does
    not know which (the pre-launch family check: its outcome says)."""
    diff = equivalence.compare(ref.result, got)  # looked up when called: the suite counts these calls
    keys = [
        k
        for k in ref.bounds.limits
        if k in diff and (params or k != "param_abs") and (not compared or k in compared)
    ]
    ratios = {k: _ratio(diff[k], ref.bounds.limits[k]) for k in keys}
    if not ratios:
        raise AssertionError(
            f"nothing to compare: {sorted(diff)} against bounds for {sorted(ref.bounds.limits)}"
        )
    worst = max(ratios, key=ratios.get)
    result = Verdict(all(r <= 1.0 for r in ratios.values()), diff, ratios, worst, ref.bounds)
    _record(result, expect_equal)
    return result


def assert_matches(ref: Reference, got: TrainResult, **kwargs) -> dict:
    """Fail unless ``got`` equals the one-process reference under the rule; return the differences."""
    result = verdict(ref, got, **kwargs)
    assert result.ok, f"differs from one process: {result.line()}; {result.diff}"
    return result.diff


def assert_differs(ref: Reference, got: TrainResult, margin: float = 100.0, **kwargs) -> Verdict:
    """A negative control: ``got`` (a broken layout) is over its bound by ``margin`` times at least."""
    result = verdict(ref, got, expect_equal=False, **kwargs)
    assert result.ratios[result.worst] >= margin, f"a fault within {margin:g}× its bound: {result.line()}"
    return result


def _largest_finite(params: dict) -> float:
    """The parameters' largest finite magnitude (Gemma 4's clamp bounds are ±inf), 1 without any."""
    import torch

    values = [p[torch.isfinite(p)].abs().max() for p in params.values() if torch.isfinite(p).any()]
    return float(max(values)) if values else 1.0


def _ratio(d: float, bound: float) -> float:
    return 0.0 if d == 0 else math.inf if not bound else d / bound


def _record(result: Verdict, expect_equal: bool | None) -> None:
    path = os.environ.get(RATIOS_ENV)
    if not path:
        return
    test = os.environ.get("PYTEST_CURRENT_TEST", "").split(" ")[0]
    line = {"test": test, "expect_equal": expect_equal, "ok": result.ok, "ratios": result.ratios}
    with open(path, "a") as f:
        f.write(json.dumps(line) + "\n")


QAT_EFFECT_FACTOR = 2.0
"""A fake-quantised run after its first level flip: within twice QAT's own effect (``quantiser_bounds``)."""


def first_steps(result: TrainResult, n: int = 1) -> TrainResult:
    """The first ``n`` steps' losses and grad norms, without the parameters (those are after the last)."""
    aux = result.aux_losses[:n] if result.aux_losses is not None else None
    return dataclasses.replace(
        result, losses=result.losses[:n], grad_norms=result.grad_norms[:n], aux_losses=aux, params=None
    )


def quantiser_bounds(quantised: TrainResult, plain: TrainResult) -> Bounds:
    """Fake quantisation (QAT) after the first step: ``QAT_EFFECT_FACTOR`` × QAT's own effect.

    A quantiser is discontinuous: once weights differ by a rounding (step 2 on), an activation on a
    level boundary (int8: a level is 1/255 of its token's range) rounds the other way in one run, that
    run's next step moves by a whole level's worth, and later activations round independently wherever
    they differ. Both runs remain fake-quantised trainings of the same model, each within QAT's own
    effect E = |quantised - unquantised| (measured: the negative control) of the unquantised run, so
    within 2E of each other (the triangle inequality); nothing here is tuned to a machine."""
    effect = compare(quantised, plain)
    limits = {k: QAT_EFFECT_FACTOR * effect[k] for k in QUANTITIES if k in effect}
    why = {k: f"{QAT_EFFECT_FACTOR:g} × QAT's own effect {effect[k]:.1e} (level flips)" for k in limits}
    return Bounds(limits, why)


def quantised_references(setup: TrainSetup, plain: TrainSetup) -> tuple[Reference, Reference]:
    """Inside one rank, for a fake-quantised ``setup`` and ``plain`` (the same without QAT): its first
    step under the rule (same weights in: the quantiser sees the same values, no level can flip) and
    all its steps under ``quantiser_bounds``."""
    exact = reference_in_rank(dataclasses.replace(setup, steps=1))
    full, off = (train_under_layout(dataclasses.replace(s, fault=None), None) for s in (setup, plain))
    return exact, Reference(full, quantiser_bounds(full, off))


def one_process_reference(setup: TrainSetup, keep_options: tuple[str, ...] = (), train=None) -> Reference:
    """The memoised reference of ``setup`` (built once per process: one 1-rank run of both ways),
    without its fault and its strategy options except ``keep_options`` (e.g. "qat_options");
    ``train``: as in ``reference_in_rank``."""
    kept = {k: v for k, v in setup.parallel_kwargs.items() if k in keep_options}
    one = dataclasses.replace(setup, parallel_kwargs=kept, fault=None)
    key = repr((one, train))
    if key not in _REFERENCES:
        _REFERENCES[key] = run_on_ranks(reference_in_rank, 1, one, train, timeout_s=600)[0]
    return _REFERENCES[key]


def one_process_quantised(setup: TrainSetup, plain: TrainSetup) -> tuple[Reference, Reference]:
    """``quantised_references`` of ``setup`` (its fault left out), memoised as ``one_process_reference``."""
    setup, plain = (dataclasses.replace(s, fault=None) for s in (setup, plain))
    key = repr(("quantised", setup, plain))
    if key not in _REFERENCES:
        _REFERENCES[key] = run_on_ranks(quantised_references, 1, setup, plain, timeout_s=600)[0]
    return _REFERENCES[key]


_REFERENCES: dict[str, Reference] = {}
"""The process's references by setup (a cache: the suite builds each once)."""
