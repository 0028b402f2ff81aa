"""``CommProfiler``: count every collective one rank issues, with its bytes, per mesh dimension.

A ``TorchDispatchMode`` sees each c10d op (``dist.all_reduce``, FSDP2's all-gather and
reduce-scatter, ``send``/``recv_`` including those issued by ``batch_isend_irecv``) and each
functional-collective op (DTensor redistributes, TP, CP's all-gather) before it runs. For a
DTensor argument it returns ``NotImplemented`` so DTensor's own dispatch runs and the plain
collectives it issues are seen (and counted once).

Byte convention (the planner's, ``ndparallel.plan.time.comms``): the bytes of the tensor(s) one rank
passes *into* one call, summed over the tensors of a coalesced call:

* all_gather: the local shard (input), not the gathered output;
* reduce_scatter: the full input (world × output);
* all_reduce, broadcast, reduce: the tensor;  all_to_all: the input;
* send: the buffer sent; recv: the buffer received (reported as separate ops);
* gather: the input; scatter: this rank's output chunk; barrier: 0.

A call is attributed to the mesh dim whose process group it used: base dims ``dp_replicate``,
``dp_shard``, ``cp``, ``tp`` and flattened ``dp``, ``dp_shard_cp``, ``dp_cp`` (and, given the expert
mesh of a mixture-of-experts run, ``efsdp`` and ``ep``). torch reuses one
group for dims with the same ranks in some cases (every dim spanning the whole world uses the
default group): the call is then reported under the first such dim in ``PREFERENCE`` and
``aliases()`` lists the others. Groups of no mesh dim are reported as ``world`` or ``group:<name>``.

Usage (one profiler per rank)::

    with CommProfiler(acc.torch_device_mesh) as prof:
        for batch in loader:
            ...                      # forward, backward, optimizer step
            prof.step()              # closes one step's record
    print(prof.format_table())       # the last step, this rank
    rows = prof.summary()            # [CommRow(dim, op, count, bytes)]
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from ndparallel.layout.mesh import submesh

BASE_DIMS = ("dp_replicate", "dp_shard", "cp", "tp")
FLAT_DIMS = ("dp_shard_cp", "dp", "dp_cp")
PREFERENCE = ("tp", "cp", "dp_shard", "dp_replicate", "dp_shard_cp", "dp", "dp_cp", "ep", "efsdp", "pp")
"""Order in which a dim name is chosen for a group shared by several dims."""

# op name -> (reported kind, name of the schema argument whose bytes are counted)
_C10D = {
    "allreduce_": ("all_reduce", "tensors"),
    "allreduce_coalesced_": ("all_reduce", "tensors"),
    "allgather_": ("all_gather", "input_tensors"),
    "_allgather_base_": ("all_gather", "input_tensor"),
    "allgather_coalesced_": ("all_gather", "input_list"),
    "allgather_into_tensor_coalesced_": ("all_gather", "inputs"),
    "reduce_scatter_": ("reduce_scatter", "input_tensors"),
    "_reduce_scatter_base_": ("reduce_scatter", "input_tensor"),
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter", "inputs"),
    "alltoall_": ("all_to_all", "input_tensors"),
    "alltoall_base_": ("all_to_all", "input"),
    "broadcast_": ("broadcast", "tensors"),
    "reduce_": ("reduce", "tensors"),
    "gather_": ("gather", "input_tensors"),
    "scatter_": ("scatter", "output_tensors"),
    "send": ("send", "tensors"),
    "recv_": ("recv", "tensors"),
    "recv_any_source_": ("recv", "tensors"),
    "barrier": ("barrier", None),
    "monitored_barrier_": ("barrier", None),
}
_FUNCOL = {
    "all_reduce": ("all_reduce", "input"),
    "all_reduce_": ("all_reduce", "input"),
    "all_reduce_coalesced": ("all_reduce", "inputs"),
    "all_reduce_coalesced_": ("all_reduce", "inputs"),
    "all_gather_into_tensor": ("all_gather", "input"),
    "all_gather_into_tensor_out": ("all_gather", "input"),
    "all_gather_into_tensor_coalesced": ("all_gather", "inputs"),
    "reduce_scatter_tensor": ("reduce_scatter", "input"),
    "reduce_scatter_tensor_out": ("reduce_scatter", "input"),
    "reduce_scatter_tensor_coalesced": ("reduce_scatter", "inputs"),
    "all_to_all_single": ("all_to_all", "input"),
    "broadcast": ("broadcast", "input"),
    "broadcast_": ("broadcast", "input"),
    "isend": ("send", "tensor"),
    "irecv": ("recv", "tensor"),
}


@dataclass(frozen=True)
class CommRow:
    """Calls of one op on one mesh dim: ``count`` calls, ``bytes`` summed over them (one rank)."""

    dim: str
    op: str
    count: int
    bytes: int


def _nbytes(x: Any) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(v) for v in x)
    return 0


def _group_name(g: Any) -> str | None:
    if isinstance(g, str):
        return g
    if isinstance(g, torch.ScriptObject):
        try:
            g = dist.ProcessGroup.unbox(g)
        except Exception:  # a ReduceOp or another script object
            return None
    return getattr(g, "group_name", None) if isinstance(g, dist.ProcessGroup) else None


def _defers(t: type) -> bool:
    """DTensor: let its own dispatch run first so the plain collectives it issues are seen once.
    (Other subclasses, e.g. FakeTensor inside DTensor's sharding propagation, run as they are.)"""
    from torch.distributed.tensor import DTensor

    return issubclass(t, DTensor)


class CommProfiler(TorchDispatchMode):
    """Record the collectives this rank issues inside the ``with`` block (see module docs).

    Args:
        mesh: the run's ``DeviceMesh`` (e.g. ``acc.torch_device_mesh``); its base and flattened
            dims name the groups. ``None``: groups are named ``world`` / ``group:<name>``.
        expert_mesh: the expert mesh of a mixture-of-experts run (``Engine.expert_mesh``): its
            ``ep`` and ``efsdp`` dims name their groups too.
    """

    def __init__(self, mesh=None, expert_mesh=None) -> None:
        super().__init__()
        self._dims_of_group: dict[str, list[str]] = {}
        if mesh is not None:
            sizes = {}
            for dim in PREFERENCE:
                source = expert_mesh if dim in ("ep", "efsdp") else mesh
                if source is None:
                    continue
                try:
                    sub = submesh(source, dim)
                except (KeyError, RuntimeError, ValueError):
                    continue  # a flattened view this mesh does not have
                sizes[dim] = sub.size()
                self._dims_of_group.setdefault(sub.get_group().group_name, []).append(dim)
            # A dim of size 1 carries no traffic; prefer a real dim sharing its group.
            for dims in self._dims_of_group.values():
                dims.sort(key=lambda d: (sizes[d] == 1, PREFERENCE.index(d)))
        self._world = dist.group.WORLD.group_name if dist.is_initialized() else None
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self._current: Counter = Counter()  # (dim, op, bytes per call) -> calls
        self._steps: list[Counter] = []
        self._paused = False

    # ------------------------------------------------------------ recording
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if any(_defers(t) for t in types):
            return NotImplemented
        if not self._paused:
            ns = func.namespace
            table = _C10D if ns == "c10d" else _FUNCOL if ns == "_c10d_functional" else None
            if table is not None:
                self._record(func, table, args, kwargs)
        return func(*args, **kwargs)

    def _record(self, func, table, args, kwargs) -> None:
        name = func._schema.name.split("::", 1)[1]
        bound = dict(zip((a.name for a in func._schema.arguments), args), **kwargs)
        group = next(
            (
                g
                for g in (_group_name(bound.get(k)) for k in ("process_group", "group_name"))
                if g is not None
            ),
            None,
        )
        dim = self.label_of_group(group)
        if name == "batch_p2p_ops":  # functional batch_isend_irecv: one send/recv per tensor
            for op, t in zip(bound["op_list"], bound["tensors"]):
                self._current[(dim, "send" if "send" in op else "recv", _nbytes(t))] += 1
            return
        if name not in table:
            return  # wait_tensor, _wrap_tensor_autograd, check_for_nan: not communication
        kind, arg = table[name]
        self._current[(dim, kind, _nbytes(bound.get(arg)) if arg else 0)] += 1

    def label_of_group(self, group_name: str | None) -> str:
        """The dim name a call on the group called ``group_name`` is reported under."""
        if group_name in self._dims_of_group:
            return self._dims_of_group[group_name][0]
        if group_name is not None and group_name == self._world:
            return "world"
        return f"group:{group_name}"

    def label(self, dim: str) -> str:
        """The name under which calls on mesh dim ``dim`` are reported (``dim`` itself unless its
        group is shared with a dim earlier in ``PREFERENCE``); ``world``: the default group's."""
        if dim == "world":
            return self.label_of_group(self._world)
        for dims in self._dims_of_group.values():
            if dim in dims:
                return dims[0]
        return dim

    def aliases(self) -> dict[str, tuple[str, ...]]:
        """Reported dim -> the other dims that use the very same process group."""
        return {dims[0]: tuple(dims[1:]) for dims in self._dims_of_group.values() if len(dims) > 1}

    def step(self) -> None:
        """Close the current step: what follows is recorded as the next step."""
        self._steps.append(self._current)
        self._current = Counter()

    # ------------------------------------------------------------- results
    @property
    def num_steps(self) -> int:
        return len(self._steps)

    def calls(self, step: int | None = None) -> dict[tuple[str, str, int], int]:
        """(dim, op, bytes per call) -> number of calls, for one step (default: the last closed
        one, or everything so far when ``step()`` was never called; ``num_steps``: the open one). Compare with
        ``ndparallel.plan.time.comms.aggregate`` (planner kind ``send_recv`` = our ``send``)."""
        if step is None:
            return dict(self._steps[-1] if self._steps else self._current)
        return dict([*self._steps, self._current][step])  # index num_steps: the open step

    def total_calls(self) -> dict[tuple[str, str, int], int]:
        """Like ``calls`` but over every step, the open one included."""
        out: Counter = Counter()
        for c in (*self._steps, self._current):
            out.update(c)
        return dict(out)

    def summary(self, step: int | None = None) -> list[CommRow]:
        """Rows (dim, op, count, bytes) of one step (see ``calls``), sorted by dim then op."""
        return _rows(self.calls(step))

    def total(self) -> list[CommRow]:
        """Rows over all recorded steps."""
        return _rows(self.total_calls())

    def gather(self, step: int | None = None, group=None) -> list[list[CommRow]]:
        """Every rank's ``summary(step)``, by rank (a collective: call it on every rank; its own
        traffic is not recorded)."""
        rows = self.summary(step)
        if not dist.is_initialized() or dist.get_world_size(group) == 1:
            return [rows]
        out: list = [None] * dist.get_world_size(group)
        self._paused, was = True, self._paused
        try:
            dist.all_gather_object(out, rows, group=group)
        finally:
            self._paused = was
        return out

    def to_json(self, step: int | None = None) -> str:
        return json.dumps({"rank": self.rank, "rows": [asdict(r) for r in self.summary(step)]})

    def format_table(self, step: int | None = None, title: str | None = None) -> str:
        """The step's rows as a text table (rich), with totals per dim."""
        return format_rows(
            self.summary(step), title or f"collectives per step, rank {self.rank}", self.aliases()
        )


def _rows(calls: dict[tuple[str, str, int], int]) -> list[CommRow]:
    count: Counter = Counter()
    nbytes: Counter = Counter()
    for (dim, op, b), n in calls.items():
        count[(dim, op)] += n
        nbytes[(dim, op)] += n * b
    return [CommRow(k[0], k[1], count[k], nbytes[k]) for k in sorted(count)]


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def format_rows(
    rows: Iterable[CommRow], title: str = "collectives", aliases: dict[str, tuple[str, ...]] | None = None
) -> str:
    """Render rows as a rich table and return its text."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for col, justify in (
        ("dim", "left"),
        ("op", "left"),
        ("calls", "right"),
        ("bytes", "right"),
        ("", "right"),
    ):
        table.add_column(col, justify=justify)
    rows = list(rows)
    for r in rows:
        dim = r.dim + (f" (= {', '.join(aliases[r.dim])})" if aliases and aliases.get(r.dim) else "")
        table.add_row(dim, r.op, str(r.count), str(r.bytes), human_bytes(r.bytes))
    if rows:
        table.add_row(
            "total",
            "",
            str(sum(r.count for r in rows)),
            str(sum(r.bytes for r in rows)),
            human_bytes(sum(r.bytes for r in rows)),
            style="bold",
        )
    import io

    console = Console(record=True, width=110, force_terminal=False, file=io.StringIO())
    console.print(table)
    return console.export_text()
