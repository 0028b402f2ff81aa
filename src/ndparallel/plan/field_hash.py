"""A frozen dataclass's hash, computed once: the planner's caches key on its model and hardware
records tens of thousands of times per search."""

from __future__ import annotations

from dataclasses import fields
from operator import attrgetter

_COMPARED: dict[type, object] = {}
"""Per class: the getter of its compared fields' values (one tuple)."""


def cached_field_hash(obj) -> int:
    """The hash of the dataclass's compared fields (what ``eq`` compares), kept on ``obj`` after
    the first call."""
    d = obj.__dict__
    h = d.get("_hash")
    if h is None:
        values = _COMPARED.get(type(obj))
        if values is None:
            names = [f.name for f in fields(obj) if f.compare]
            get = attrgetter(*names)
            values = _COMPARED[type(obj)] = get if len(names) > 1 else lambda o: (get(o),)
        h = d["_hash"] = hash(values(obj))
    return h
