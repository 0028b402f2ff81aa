"""A test file's layout runs, several on one forked rank group: the tests that train under the same
layout share one ``run_on_ranks`` call, which trains each of their setups in turn.

Each forked group otherwise pays again for what the runs of one layout have in common: forking the
ranks, the process group and mesh, and DTensor's sharding decisions for every op (torch caches them
per process; ~60 % of a 4-rank FSDP 2 × TP 2 rank's CPU in a 3-step run). Every test still checks
its own run. A run that raises ends the group at once (its peers may be waiting in a collective, so
no rank may go on to the next run): every test of the group not yet done fails with the first
failing rank's traceback, which names the run.
"""

from __future__ import annotations

from ndparallel.testing import RankFailure, run_on_ranks
from ndparallel.tools.equivalence import TrainResult, TrainSetup, train_under_layout


def train_each(setups: dict[str, TrainSetup], layout: dict) -> dict[str, TrainResult]:
    """On every rank of one group: ``train_under_layout`` of each setup in turn; an error names its
    run and ends the group."""
    out: dict[str, TrainResult] = {}
    for name, setup in setups.items():
        try:
            out[name] = train_under_layout(setup, layout)
        except Exception as e:
            e.add_note(f"(layout run {name!r}, the group's runs before it: {list(out)})")
            raise
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
            try:
                self.results.update(run_on_ranks(train_each, world, group, layout, timeout_s=timeout_s)[0])
            except RankFailure as e:
                self.results.update({n: f"the group of {list(group)} failed:\n{e}" for n in group})
        got = self.results[name]
        assert not isinstance(got, str), f"{name} raised on the ranks:\n{got}"
        return got
