"""Byte sizes as people write them: ``--gpu-mem 80GB``, ``max_shard_size="5GB"``, ``141GiB``, ``4e10``."""

from __future__ import annotations

import re

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1e3,
    "kb": 1e3,
    "m": 1e6,
    "mb": 1e6,
    "g": 1e9,
    "gb": 1e9,
    "t": 1e12,
    "tb": 1e12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def parse_size(text: str | float, *, gb_is_gib: bool = False, bare_unit: str = "b") -> float:
    """'80GB' -> bytes. With ``gb_is_gib`` (memory sizes), GB/MB/TB mean GiB/MiB/TiB, as GPU
    memory is quoted. A number without a unit is read in ``bare_unit`` (bytes by default)."""
    if isinstance(text, (int, float)):
        return float(text) * _UNITS[bare_unit]
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"cannot read a size from {text!r} (e.g. '80GB', '141GiB', '4e10')")
    unit = m.group(2).lower() or bare_unit
    if gb_is_gib and unit in ("k", "kb", "m", "mb", "g", "gb", "t", "tb"):
        unit = unit[0] + "ib"
    return float(m.group(1)) * _UNITS[unit]
