"""Run one function on N CPU ranks (gloo), each a forked child, and collect the results.

Forking after ``torch`` and ``transformers`` are imported once in the parent costs ~0.1 s a rank
instead of ~3-15 s for spawn. The parent must hold no garbage that owns threads (a finished run's
process group: collected in a child, its finalizer waits forever for threads fork did not copy;
``runtime.launch.run_here`` collects its run's cycles itself). Every child calls
``torch.set_num_threads(1)`` first: forked children
running two OpenMP threads after the parent used threads were seen to hang. tqdm's locks are made
anew in each child (``_fresh_tqdm_locks``). A rank that raises
fails the call at once with its rank and traceback; a hard deadline kills every child by PID.
"""

from __future__ import annotations

import os
import pickle
import random
import signal
import socket
import time
import traceback
from collections.abc import Callable
from multiprocessing import connection, get_context
from typing import Any


class RankFailure(RuntimeError):
    """One or more ranks raised, died or timed out; the message names them."""


def free_port() -> int:
    """A free local TCP port for a rendezvous that binds it later (``MASTER_PORT``, a c10d
    endpoint), chosen below the kernel's ephemeral range where it can: a port the kernel hands out
    for ``bind(0)`` may be taken by anyone in between — gloo alone binds many, and tests run side
    by side — while a port below that range is taken only by another explicit choice (of ~12,000)."""
    low = _ephemeral_low()
    for _ in range(50):
        port = random.randrange(max(1024, low - 12000), low) if low > 2048 else 0
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return s.getsockname()[1]
    raise RuntimeError("no free local port found")


def _ephemeral_low() -> int:
    try:
        return int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
    except (OSError, ValueError, IndexError):
        return 0  # unknown: let the kernel choose


def _listening_socket() -> socket.socket:
    """A socket listening on a free local port, opened before the ranks fork and handed to rank
    0's store (``master_listen_fd``): the port is never free in between. (Choosing a free port and
    binding it later raced with other tests running beside this one: EADDRINUSE.)"""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    return sock


def _start_group(rank: int, world_size: int, port: int, listen_fd: int, timeout_s: float) -> None:
    """The default gloo group of a forked rank, over a store rank 0 serves on the inherited socket."""
    import datetime

    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=timeout_s)
    if rank == 0:
        store = dist.TCPStore("127.0.0.1", port, world_size, True, timeout, master_listen_fd=listen_fd)
    else:
        os.close(listen_fd)
        store = dist.TCPStore("127.0.0.1", port, world_size, False, timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=timeout)


def _fresh_tqdm_locks() -> None:
    """In a forked child: new, unheld locks for every tqdm class that has its own.

    A progress bar in the parent (``save_pretrained``'s "Writing model shards") leaves tqdm's
    monitor thread running there; every 10 s it takes the class's write lock. A fork in that
    instant copies the lock held by a thread the child does not have, and the child's first bar
    (``from_pretrained``'s "Loading weights") waits forever. ``tqdm.set_lock`` is tqdm's own hook
    for choosing the lock; a plain ``RLock`` is what its default lock holds per process.
    """
    import sys
    import threading

    std = sys.modules.get("tqdm.std")
    if std is None:
        return
    pending, seen = [std.tqdm], set()
    while pending:
        cls = pending.pop()
        if cls in seen:
            continue
        seen.add(cls)
        pending.extend(cls.__subclasses__())
        if "_lock" in vars(cls) or cls is std.tqdm:
            cls.set_lock(threading.RLock())


def _child(
    rank: int, world_size: int, port: int, listen_fd: int, conn, fn, args, kwargs, pg_timeout_s: float, env
):
    try:
        import torch

        torch.set_num_threads(1)
        # ... and the libraries that size their own pools from the environment keep to it too
        # (Accelerate's CPU state calls torch.set_num_threads(cores) when OMP_NUM_THREADS is unset).
        os.environ["OMP_NUM_THREADS"] = "1"
        _fresh_tqdm_locks()
        os.environ.update(
            RANK=str(rank),
            WORLD_SIZE=str(world_size),
            LOCAL_RANK=str(rank),
            LOCAL_WORLD_SIZE=str(world_size),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            NDPARALLEL_DEVICE="cpu",  # the ranks are CPU/gloo ranks even where GPUs are visible
        )
        os.environ.update(env)
        from ndparallel.runtime.distributed import init_distributed, shutdown

        _start_group(rank, world_size, port, listen_fd, pg_timeout_s)
        init_distributed("cpu", timeout_s=pg_timeout_s)  # this rank's info, on the group just started
        result = fn(*args, **kwargs)
        payload, ok = pickle.dumps(("ok", result)), True
    except BaseException as exc:  # noqa: BLE001 - report everything, including SystemExit
        payload = pickle.dumps(("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
        ok = False
    try:
        conn.send_bytes(payload)
        conn.close()
        if ok:
            _wait_for_peers()
    finally:
        try:
            shutdown()
        except Exception:
            pass
        os._exit(0)


def _wait_for_peers() -> None:
    """Rank 0 hosts the rendezvous store: nobody leaves (taking it down) while a peer may still be
    creating process groups. A failed peer makes the parent kill us, so this cannot hang a test."""
    import torch.distributed as dist

    if dist.is_initialized():
        try:
            dist.barrier()
        except Exception:
            pass


def run_on_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout_s: float = 240.0,
    env: dict[str, str] | None = None,
    **kwargs: Any,
) -> list[Any]:
    """Call ``fn(*args, **kwargs)`` on ``world_size`` forked gloo ranks; return results by rank.

    ``fn`` runs after the default gloo process group is initialised, with ``RANK``/``WORLD_SIZE`` set
    and ``NDPARALLEL_DEVICE=cpu`` (an ``Accelerator`` built inside uses the CPU even where GPUs are
    visible). Raises ``RankFailure`` naming the failing rank(s) with their tracebacks, or the ranks
    still running at the deadline (which are killed).
    """
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        # A forked child would inherit this process group without its communication threads
        # (fork copies only the calling thread): collectives on it crash or hang.
        raise RuntimeError(
            "run_on_ranks: this process already has a default process group; call "
            "it from a process without one (destroy_process_group() first)"
        )
    ctx = get_context("fork")
    listener = _listening_socket()
    port = listener.getsockname()[1]
    # A rank stuck in a collective gives up a little before our own deadline.
    pg_timeout_s = max(5.0, timeout_s - 5.0)
    procs, conns = [], {}
    for rank in range(world_size):
        parent_end, child_end = ctx.Pipe(duplex=False)
        p = ctx.Process(
            target=_child,
            args=(
                rank,
                world_size,
                port,
                listener.fileno(),
                child_end,
                fn,
                args,
                kwargs,
                pg_timeout_s,
                env or {},
            ),
            daemon=True,
        )
        p.start()
        child_end.close()
        procs.append(p)
        conns[parent_end] = rank
    listener.close()  # rank 0 holds its own copy
    results: dict[int, Any] = {}
    errors: dict[int, str] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while conns and not errors:
            ready = connection.wait(list(conns), timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                break
            for c in ready:
                rank = conns.pop(c)
                try:
                    status, value = pickle.loads(c.recv_bytes())
                except EOFError:
                    status, value = "error", f"rank {rank} died (exit code {procs[rank].exitcode})"
                (results if status == "ok" else errors)[rank] = value
        missing = sorted(conns.values())
    finally:
        _kill_all(procs, grace_s=0.5 if errors or conns else 5.0)
    if errors:
        first = next(iter(errors))  # the first reported: later ones may be its consequences
        others = f" (ranks {sorted(errors)} failed)" if len(errors) > 1 else ""
        raise RankFailure(f"rank {first} of {world_size} raised{others}:\n{errors[first]}")
    if missing:
        raise RankFailure(
            f"ranks {missing} of {world_size} did not finish within {timeout_s:.0f} s and were killed"
        )
    return [results[r] for r in range(world_size)]


def _kill_all(procs, grace_s: float) -> None:
    end = time.monotonic() + grace_s
    for p in procs:
        p.join(timeout=max(0.0, end - time.monotonic()))
    for p in procs:
        if p.is_alive() and p.pid is not None:
            try:
                os.kill(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.join(timeout=5)
