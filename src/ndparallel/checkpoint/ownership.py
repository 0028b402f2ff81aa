"""Which entries of an ``output_dir`` the run that uses it wrote: nothing else is ever deleted or
overwritten (a previous run's checkpoints, a user's own ``metrics.png`` or ``final/``).

``ndparallel train`` starts every run by writing ``output_dir/.ndparallel-run.json``::

    {"format": "ndparallel-run/1", "run_id": "…", "started": 1733000000.0,
     "written": ["config.resolved.yaml", "metrics.jsonl", "final", "checkpoint-2", …]}

Each top-level entry is *claimed* (added to ``written``) on rank 0 before it is first written, so
an interrupted write is still known to be the run's own. Before deleting or replacing an entry,
rotation and saves ask ``may_replace``. A resumed run keeps the file (it is the same run); a new
run with ``overwrite_output_dir`` deletes the previous run's claimed entries and starts a new file.

A directory without the file (checkpoints saved through the Python API) belongs to its caller:
``may_replace`` allows everything there, as before. An unreadable file claims nothing (so
nothing is replaced). The file is rewritten atomically (``write_json_atomic``).
"""

from __future__ import annotations

import os
import time
import uuid
from pathlib import Path

from ndparallel.checkpoint.io import read_json, write_json_atomic

RUN_FILE = ".ndparallel-run.json"
FORMAT = "ndparallel-run/1"


def read_run(output_dir: str | os.PathLike) -> dict | None:
    """The run record of ``output_dir``; None without one; ``written == []`` if unreadable."""
    path = Path(output_dir) / RUN_FILE
    if not path.is_file():
        return None
    try:
        run = read_json(path)
        if run.get("format") != FORMAT or not all(isinstance(n, str) for n in run["written"]):
            raise ValueError(f"format {run.get('format')!r}")
        return run
    except Exception:  # noqa: BLE001 - an unreadable record claims nothing
        return {"format": FORMAT, "run_id": None, "written": [], "unreadable": True}


def start_run(output_dir: str | os.PathLike) -> str:
    """A new run record (no entry claimed yet); returns its run id. Rank 0 only."""
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    run_id = uuid.uuid4().hex
    write_json_atomic(
        out / RUN_FILE, {"format": FORMAT, "run_id": run_id, "started": time.time(), "written": []}
    )
    return run_id


def claim(output_dir: str | os.PathLike, *names: str) -> None:
    """Record that the current run writes the top-level entries ``names`` (before writing them).
    No-op in a directory without a run record (Python API use). Rank 0 only."""
    run = read_run(output_dir)
    if run is None or run.get("unreadable"):
        return
    new = [n for n in names if n not in run["written"]]
    if new:
        run["written"] = [*run["written"], *new]
        write_json_atomic(Path(output_dir) / RUN_FILE, run)


def may_replace(path: str | os.PathLike) -> bool:
    """May the run owning ``path``'s parent directory delete or overwrite ``path``?"""
    path = Path(path)
    run = read_run(path.parent)
    return run is None or path.name in run["written"]
