"""A test file's layout runs, several on one forked rank group: the tests that train under the same
layout share one ``run_on_ranks`` call, which trains each of their setups in turn.

Each forked group otherwise pays again for what the runs of one layout have in common: forking the
ranks, the process group and mesh, and DTensor's sharding decisions for every op (torch caches them
per process; ~60 % of a 4-rank FSDP 2 × TP 2 rank's CPU in a 3-step run). Every test still checks
its own run; a run that raises fails its own test only, with its rank's traceback.
"""

from __future__ import annotations

import traceback

from ndparallel.testing import run_on_ranks
from ndparallel.tools.equivalence import TrainResult, TrainSetup, train_under_layout


def train_each(setups: dict[str, TrainSetup], layout: dict) -> dict[str, TrainResult | str]:
    """On every rank of one group: ``train_under_layout`` of each setup in turn (a setup that
    raises gives its error and traceback)."""
    out: dict[str, TrainResult | str] = {}
    for name, setup in setups.items():
        try:
            out[name] = train_under_layout(setup, layout)
        except Exception as e:  # noqa: BLE001 - reported by the test of that setup
            out[name] = f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
    return out


class LayoutRuns:
    """``cases``: name -> (setup, layout, world). ``runs(name)`` is that case's rank-0 result; the
    first case asked for of a (layout, world) runs every case of it, on one group."""

    def __init__(self, cases: dict[str, tuple[TrainSetup, dict, int]], timeout_s_per_run: float = 200.0):
        self.cases = cases
        self.timeout_s_per_run = timeout_s_per_run
        self.results: dict[str, TrainResult | str] = {}

    def __call__(self, name: str) -> TrainResult:
        if name not in self.results:
            _, layout, world = self.cases[name]
            group = {n: setup for n, (setup, lay, w) in self.cases.items() if (lay, w) == (layout, world)}
            timeout_s = self.timeout_s_per_run * len(group)
            self.results.update(run_on_ranks(train_each, world, group, layout, timeout_s=timeout_s)[0])
        got = self.results[name]
        assert not isinstance(got, str), f"{name} raised on the ranks:\n{got}"
        return got
