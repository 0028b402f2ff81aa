"""Which node went away: a heartbeat per launcher in the job's rendezvous store.

On several nodes a launcher only sees its own ranks. When another node dies (power, kernel, a
``kill -9`` of its launcher — whose ranks then die too, ``lifeline.py``), the ranks here fail in
their next collective with "connection closed by peer", which names an address, not a node. So
each ``ndparallel launch`` of a multi-node c10d job takes a slot in the rendezvous store (an
atomic counter) and writes there, once a second, its host, pid, global ranks (read from its
children's environment) and a beat counter. When this node's ranks fail, the launcher reads every
slot twice, three beats apart: a node whose counter stopped is named, with its ranks and the
state it wrote last ("failed: ..." when its own launcher saw its ranks fail first). Counters, not
clocks, so clock skew between hosts does not matter. Store traffic: one small write per node per
second.
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import threading
import time
from pathlib import Path

BEAT_S = 1.0
_PREFIX = "ndparallel/nodes"


class NodeWatch:
    """Heartbeats of the launchers of one job (``run_id``) through the store at ``host:port``."""

    def __init__(self, host: str, port: int, run_id: str, beat_s: float = BEAT_S):
        self.host, self.port, self.run_id, self.beat_s = host, port, run_id, beat_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._store = None
        self._slot: int | None = None
        self._beats = 0
        self._state = "running"
        self._lock = threading.Lock()

    def _key(self, what: str) -> str:
        return f"{_PREFIX}/{self.run_id}/{what}"

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="ndparallel-node-watch", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _connect(self):
        import torch.distributed as dist

        return dist.TCPStore(
            self.host,
            self.port,
            is_master=False,
            wait_for_workers=False,
            timeout=datetime.timedelta(seconds=10),
        )

    def _run(self) -> None:
        deadline = time.monotonic() + 600  # the store appears once the rendezvous host is up
        while not self._stop.is_set() and self._store is None and time.monotonic() < deadline:
            try:
                self._store = self._connect()
                self._slot = int(self._store.add(self._key("count"), 1)) - 1
            except Exception:  # noqa: BLE001 - not up yet: try again
                self._store = None
                self._stop.wait(self.beat_s)
        while self._store is not None and not self._stop.is_set():
            self._beat()
            self._stop.wait(self.beat_s)

    def _beat(self) -> None:
        with self._lock:
            self._beats += 1
            record = {
                "host": socket.gethostname(),
                "pid": os.getpid(),
                "ranks": _child_ranks(),
                "beat": self._beats,
                "state": self._state,
            }
            try:
                self._store.set(self._key(f"slot/{self._slot}"), json.dumps(record))
            except Exception:  # noqa: BLE001 - the store host is gone; diagnose() says so
                pass

    def diagnose(self, own_ranks: set[int]) -> list[str]:
        """Lines naming the other nodes that stopped beating (or that failed first), after this
        node's ranks ``own_ranks`` failed. Waits about three beats."""
        self._state = f"failed: ranks {sorted(own_ranks)}"
        if self._store is None:
            return []
        if self._slot is not None:
            self._beat()
        try:
            first = self._read_all()
            time.sleep(3 * self.beat_s)
            second = self._read_all()
        except Exception:  # noqa: BLE001
            return [
                f"ndparallel launch: the rendezvous store at {self.host}:{self.port} is unreachable: "
                "the node hosting it (the first launcher to start) is down or cut off"
            ]
        lines = []
        for slot, rec in sorted(second.items()):
            if slot == self._slot:
                continue
            before = first.get(slot, rec)
            where = f"node {_ranks_text(rec['ranks'])} on {rec['host']} (launcher pid {rec['pid']})"
            if rec["beat"] == before["beat"] and rec["state"] == "running":
                lines.append(
                    f"ndparallel launch: {where} stopped responding: its launcher or machine died "
                    "(its ranks went with it); this node's ranks failed because of it"
                )
            elif rec["state"] != "running":
                lines.append(f"ndparallel launch: {where} reported its own failure ({rec['state']})")
        return lines

    def _read_all(self) -> dict[int, dict]:
        count = int(self._store.add(self._key("count"), 0))
        out = {}
        for slot in range(count):
            key = self._key(f"slot/{slot}")
            if self._store.check([key]):
                out[slot] = json.loads(self._store.get(key))
        return out


def _ranks_text(ranks: list[int]) -> str:
    if not ranks:
        return "(ranks unknown)"
    if ranks == list(range(ranks[0], ranks[-1] + 1)) and len(ranks) > 1:
        return f"with ranks {ranks[0]}-{ranks[-1]}"
    return f"with rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"


def _child_ranks() -> list[int]:
    """Global ranks of this process's children (the elastic agent's workers), from /proc."""
    me, ranks = os.getpid(), []
    proc = Path("/proc")
    if not proc.is_dir():
        return ranks
    for d in proc.iterdir():
        if not d.name.isdigit():
            continue
        try:
            if int((d / "stat").read_text().rsplit(")", 1)[1].split()[1]) != me:
                continue
            env = dict(
                e.split("=", 1)
                for e in (d / "environ").read_bytes().decode(errors="replace").split("\0")
                if "=" in e
            )
        except (OSError, IndexError, ValueError):
            continue
        if env.get("RANK", "").isdigit():
            ranks.append(int(env["RANK"]))
    return sorted(ranks)


def node_watch_for(args) -> NodeWatch | None:
    """A ``NodeWatch`` for a multi-node job with a c10d rendezvous (``--rdzv-backend c10d
    --rdzv-endpoint host:port``), else None."""
    nnodes = str(args.nnodes)
    most = int(nnodes.split(":")[-1]) if nnodes.replace(":", "").isdigit() else 1
    if (
        most <= 1
        or args.rdzv_backend != "c10d"
        or not args.rdzv_endpoint
        or getattr(args, "standalone", False)
    ):
        return None
    host, _, port = str(args.rdzv_endpoint).rpartition(":")
    if not host or not port.isdigit():
        host, port = str(args.rdzv_endpoint), "29400"  # c10d's default port
    return NodeWatch(host.strip("[]"), int(port), str(args.rdzv_id))
