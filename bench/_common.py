"""Shared helpers of the benchmark scripts: the ndparallel training step, tables, JSON results."""

from __future__ import annotations

import datetime
import json
import os
import platform
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

RESULTS = Path(__file__).resolve().parent / "results"
RESULTS_ENV = "BENCH_RESULTS_DIR"
"""Where ``write_json`` writes instead of ``bench/results`` when set (``bench/gpu_all.sh`` points it
into its ``--out`` folder, the one that comes back from a GPU machine; tests into a temporary one)."""


def results_dir() -> Path:
    """``$BENCH_RESULTS_DIR`` if set, else ``bench/results`` (git-ignored)."""
    return Path(os.environ.get(RESULTS_ENV) or RESULTS)


def machine() -> dict[str, Any]:
    return {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "host": platform.node(),
        "cpu_cores": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }


def write_json(name: str, payload: dict) -> Path:
    """Write ``<results_dir()>/<name>.json`` with the machine description added; atomically (a
    temporary file renamed), so a run killed mid-write leaves the previous complete file."""
    out = results_dir()
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps({"machine": machine(), **payload}, indent=2, default=str))
    tmp.replace(path)
    return path


def print_table(title: str, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for i, c in enumerate(columns):
        table.add_column(c, justify="left" if i == 0 else "right")
    for r in rows:
        table.add_row(*(_fmt(v) for v in r))
    Console(width=140).print(table)


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1000 else f"{v:,.0f}"
    if isinstance(v, int):
        return f"{v:,}"
    return str(v)


def local_micro_batch(acc, micro: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """This rank's dp slice of a global micro-batch."""
    rows = next(iter(micro.values())).shape[0] // acc.dp_size
    lo = acc.dp_rank * rows
    return {k: v[lo : lo + rows].contiguous().to(acc.device) for k, v in micro.items()}


def nd_step(acc, model, optimizer, mb: dict[str, torch.Tensor], max_norm: float | None = 1.0):
    """One optimizer step through the public Accelerator API (one micro-batch): global token
    count, CP sharding, token-sum loss, backward, clipping, AdamW."""
    from ndparallel.engine import forward_backward

    loss = forward_backward(acc.engine, model, [mb])  # the very step `ndparallel train` runs
    if max_norm is not None:
        acc.clip_grad_norm_(model.parameters(), max_norm)
    optimizer.step()
    optimizer.zero_grad()
    return loss


def layout_world(layout: dict[str, int]) -> int:
    n = 1
    for v in layout.values():
        n *= v
    return n


def vm_bytes(field: str) -> int:
    """A byte count from this process's /proc/self/status (e.g. ``VmHWM:``, ``RssAnon:``)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field):
            return int(line.split()[1]) * 1024
    return 0


class AnonPeak:
    """Samples RssAnon (private, non-file memory) every 20 ms: the kernel keeps no peak of it."""

    def __init__(self):
        import threading

        self.peak, self._stop = 0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        while not self._stop.wait(0.02):
            self.peak = max(self.peak, vm_bytes("RssAnon:"))

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return max(self.peak, vm_bytes("RssAnon:"))
