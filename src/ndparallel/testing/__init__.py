"""Helpers for testing distributed code on CPU: run a function on N gloo ranks from pytest."""

from ndparallel.runtime.multirank import RankFailure, run_on_ranks

__all__ = ["RankFailure", "run_on_ranks"]
