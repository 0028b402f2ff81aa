"""The sequence-tiled MLP's tile rule, in one place: how many tiles one MLP call cuts its rows into
and how long each is. The runtime (``TiledMLPMixin``), the planner
(``plan/memory/long_context.py``) and the pre-launch plan text (``preflight/plan_text.py``) all ask it.
Imports nothing heavy (``ndparallel plan`` starts without torch)."""

from __future__ import annotations

import math


def tile_split(length: int, hidden: int, num_tiles: int | None = None) -> tuple[int, int]:
    """(tiles, tokens per tile) of a row of ``length`` tokens: ``num_tiles`` (the configured
    count), else ALST's rule — tiles of about ``hidden`` tokens, so one tile's
    ``tile × intermediate`` activations are about the size of one MLP weight — at most one tile per
    token. Every tile is ``ceil(length / tiles)`` tokens but the last (``torch.chunk``'s sizes)."""
    tiles = max(1, min(length, num_tiles or math.ceil(length / max(1, hidden))))
    return tiles, math.ceil(length / tiles)


def tile_spans(length: int, hidden: int, num_tiles: int | None = None) -> list[tuple[int, int]]:
    """(start, length) of the tiles of ``tile_split`` (``torch.chunk``'s sizes)."""
    _, step = tile_split(length, hidden, num_tiles)
    return [(s, min(step, length - s)) for s in range(0, length, step)]
