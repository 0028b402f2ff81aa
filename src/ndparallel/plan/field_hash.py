"""A frozen dataclass's hash, computed once: the planner's caches key on its model and hardware
records tens of thousands of times per search."""

from __future__ import annotations

from dataclasses import fields


def cached_field_hash(obj) -> int:
    """The hash the dataclass would generate (of its compared fields), kept on ``obj`` after the
    first call."""
    h = obj.__dict__.get("_hash")
    if h is None:
        h = hash(tuple(getattr(obj, f.name) for f in fields(obj) if f.compare))
        object.__setattr__(obj, "_hash", h)
    return h
