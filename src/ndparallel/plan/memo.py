"""Bounded memo tables for the search's hot functions: a function of some fields of ``Settings``
(and of the model and layout) computed once per distinct value of those fields, its key their
values (``operator.attrgetter``: no ``Settings`` built or hashed per ask).

A function memoised this way must read no other field: ``tests/test_plan_memo.py`` changes every
other field of ``Settings`` one at a time and checks each such function's answer does not move."""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

_MISSING = object()
_ALL: list[Memo] = []


class Memo:
    """``get(key, compute)``: ``compute()``'s value, computed on the first ``get`` of ``key``; the
    table is emptied when it holds ``maxsize`` entries (the search's own keys repeat within one
    request)."""

    def __init__(self, maxsize: int = 16384) -> None:
        self.maxsize = maxsize
        self.table: dict[Hashable, Any] = {}
        _ALL.append(self)

    def get(self, key: Hashable, compute: Callable[[], Any]) -> Any:
        value = self.table.get(key, _MISSING)
        if value is _MISSING:
            if len(self.table) >= self.maxsize:
                self.table.clear()
            value = self.table[key] = compute()
        return value


def clear_memos() -> None:
    """Empty every ``Memo`` (a test that replaces a function they memoise)."""
    for memo in _ALL:
        memo.table.clear()
