"""What the Trainer door's tests share: the peers' recorded runs (``tests/fixtures/trainer/``, written
by ``bench/peers/hf_trainer.py``) as references under the project's rule, and our copy of
Accelerate's ``nd_parallel_trainer.py`` run on forked CPU ranks."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

from ndparallel.testing import run_on_ranks
from ndparallel.tools.agreement import Reference, measured_bounds
from ndparallel.tools.equivalence import TrainResult, TrainSetup

FIXTURES = Path(__file__).parent / "fixtures" / "trainer"
QUIET_HUB = {"HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1"}


def fixture(name: str) -> dict:
    return json.loads((FIXTURES / f"{name}.json").read_text())


def _result(run: dict, metric: str | None, start: int) -> TrainResult:
    if metric is None:
        return TrainResult(losses=run["losses"][start:], grad_norms=run["grad_norms"][start:], params=None)
    values = run[metric][start:]  # another logged quantity, compared as the losses (``compared=``)
    return TrainResult(losses=values, grad_norms=values, params=None)


def peer_reference(
    recorded: dict, run: str, model_config, *, metric: str | None = None, start: int = 0
) -> Reference:
    """The peer's run ``run`` of a fixture (from step ``start``; ``metric``: another quantity it
    recorded, e.g. ``eval_losses``, as the losses) as the reference, its bounds from its own second
    way (``tools/agreement.py``; a run without one — a one-row batch — is its own) and the parameter
    count the fixture records (the rule's fp32 floor)."""
    group = recorded["runs"][run]
    first = _result(group["first"], metric, start)
    seconds = [_result(r, metric, start) for k, r in group.items() if k != "first"] or [first]
    bounds = measured_bounds(TrainSetup(model_config), first, *seconds, n_params=recorded["n_params"])
    return Reference(first, bounds)


def steps_of(history: list[dict], start: int = 0) -> TrainResult:
    """The per-step loss and gradient norm a Trainer logged (``logging_steps=1``), from ``start``."""
    steps = [h for h in history if "loss" in h and "grad_norm" in h][start:]
    losses, norms = [h["loss"] for h in steps], [h["grad_norm"] for h in steps]
    return TrainResult(losses=losses, grad_norms=norms, params=None)


def logged(history: list[dict], key: str) -> TrainResult:
    """Every value of ``key`` a Trainer logged, as the losses of a result (see ``peer_reference``)."""
    values = [h[key] for h in history if key in h]
    return TrainResult(losses=values, grad_norms=values, params=None)


def _script(argv: list[str]) -> list[dict]:
    from accelerate_scripts import nd_parallel_trainer

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return nd_parallel_trainer.main(argv)


def run_trainer_script(layout: dict[str, int], argv: list[str], timeout_s: float = 240.0) -> list[list[dict]]:
    """Our copy of Accelerate's ``nd_parallel_trainer.py`` on forked CPU ranks, the layout from the
    ``PARALLELISM_CONFIG_*`` environment variables as ``accelerate launch`` sets them; every rank's
    log history."""
    world = 1
    for size in layout.values():
        world *= size
    env = {f"PARALLELISM_CONFIG_{k.upper()}": str(v) for k, v in layout.items()} | QUIET_HUB
    return run_on_ranks(_script, world, argv, env=env, timeout_s=timeout_s)
