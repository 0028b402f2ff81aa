"""The host-memory budget of activation offloading, in one place: the share of a machine's
available memory its ranks' offloaded activations may use. The runtime's offloader
(``offload.py``: over its budget, further tensors stay on the device), the planner (``--host-mem``:
``plan/search/evaluation.py``) and the check before launch (``preflight/host_memory.py``) all ask it.
Imports nothing heavy (``ndparallel plan`` starts without torch)."""

from __future__ import annotations

HOST_BUDGET_FRACTION = 0.8
"""Share of the host's available memory the offloaded activations of a node's ranks may use."""


def available_host_memory() -> int | None:
    """This machine's available memory in bytes (``MemAvailable``; None if unknown)."""
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f)
        return int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return None


def host_budget(ranks_here: int, available: int | None) -> int | None:
    """One rank's share of ``HOST_BUDGET_FRACTION`` of ``available`` bytes, ``ranks_here`` ranks
    on the machine (None if ``available`` is unknown)."""
    if available is None:
        return None
    return int(HOST_BUDGET_FRACTION * available) // max(1, ranks_here)
