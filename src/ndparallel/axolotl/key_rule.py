"""One rule of the Axolotl key tables (``keys.py``, ``noop_keys.py``): what ndparallel does with a key."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Rule:
    kind: str  # mapped | ignored | noop
    text: str  # mapped: to what; ignored: why nothing changes; noop: the fix when it is set
    default: object = None  # noop: Axolotl's default value (also accepted)


def _all(kind: str, text: str, *keys: str, default=None) -> dict[str, Rule]:
    return {k: Rule(kind, text, default) for k in keys}


def _defaults(kind: str, text: str, **keys) -> dict[str, Rule]:
    return {k: Rule(kind, text, d) for k, d in keys.items()}
