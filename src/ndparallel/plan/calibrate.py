"""Measure this machine: matmul rate, memory bandwidth, collective latency/bandwidth per group
size (gloo on forked CPU ranks, NCCL on local GPUs), written as a hardware profile JSON."""

from __future__ import annotations

import json
import os
import socket
import time

from ndparallel.plan.comms import KINDS
from ndparallel.plan.hardware import GiB, Hardware

# Ring-model coefficients of t = k_alpha·α + k_beta·b/B for input bytes b on n ranks.
_COEF = {
    "all_gather": lambda n: (n - 1, n - 1),
    "reduce_scatter": lambda n: (n - 1, (n - 1) / n),
    "all_reduce": lambda n: (2 * (n - 1), 2 * (n - 1) / n),
    "send_recv": lambda n: (1, 1),
}


def fit_alpha_beta(kind: str, n: int, sizes: list[int], seconds: list[float]) -> dict:
    """Least-squares line t = c0 + c1·b, read back as the ring model's α and bus bandwidth B."""
    m = len(sizes)
    mx, my = sum(sizes) / m, sum(seconds) / m
    var = sum((x - mx) ** 2 for x in sizes)
    c1 = sum((x - mx) * (y - my) for x, y in zip(sizes, seconds)) / var if var else 0.0
    c0 = my - c1 * mx
    ka, kb = _COEF[kind](n)
    c1 = max(c1, 1e-15)
    return {"alpha_s": max(c0, 0.0) / ka, "bus_bw": kb / c1}


def measure_matmul(device: str, dtype_name: str, n: int, reps: int = 5) -> float:
    """FLOP/s of an n×n×n matmul (best of ``reps``)."""
    import torch

    dtype = getattr(torch, dtype_name)
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    best = float("inf")
    for _ in range(reps + 1):
        _sync(device)
        t0 = time.perf_counter()
        a @ b
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best


def measure_copy_bw(device: str, nbytes: int) -> float:
    """Bytes/s read + written by a large tensor copy."""
    import torch

    src = torch.empty(nbytes // 4, device=device, dtype=torch.float32).fill_(1.0)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(4):
        _sync(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return 2 * nbytes / best


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


def collective_bench(device: str, sizes: list[int], iters: int) -> dict:
    """Run inside every rank (process group up): time each collective kind per group size.

    Groups are the first n ranks for n = 2, 4, ... and the world. Returns on every rank
    {kind: {n: [seconds per size]}} (rank 0's timings; a barrier brackets each measurement)."""
    import torch
    import torch.distributed as dist

    world, rank = dist.get_world_size(), dist.get_rank()
    ns = sorted({n for n in (2, 4, 8, 16, 32, 64) if n < world} | {world})
    groups = {n: dist.new_group(list(range(n))) for n in ns}
    out: dict = {k: {} for k in KINDS}
    for n in ns:
        if rank >= n:
            # Still take part in the barriers of the default group below.
            for _ in KINDS:
                for _ in sizes:
                    dist.barrier()
            continue
        g = groups[n]
        for kind in KINDS:
            times = []
            for size in sizes:
                x = torch.ones(size // 4, device=device)
                big = torch.empty(size // 4 * n, device=device)
                dist.barrier(group=g)
                _sync(device)
                t0 = time.perf_counter()
                for _ in range(iters):
                    _one(kind, x, big, g, n, rank)
                _sync(device)
                times.append((time.perf_counter() - t0) / iters)
                dist.barrier()
            out[kind][n] = times
    return out


def _one(kind, x, big, g, n, rank):
    import torch.distributed as dist

    if kind == "all_gather":  # *_single are the torch >= 2.13 names of *_into_tensor / *_tensor
        (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(big, x, group=g)
    elif kind == "reduce_scatter":
        (getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor)(x, big, group=g)
    elif kind == "all_reduce":
        dist.all_reduce(x, group=g)
    else:
        peer_next = (rank + 1) % n
        peer_prev = (rank - 1) % n
        recv = x.clone()
        ops = [dist.P2POp(dist.isend, x, peer_next, group=g),
               dist.P2POp(dist.irecv, recv, peer_prev, group=g)]
        for r in dist.batch_isend_irecv(ops):
            r.wait()


def _fit_all(raw: dict, sizes: list[int]) -> dict:
    table: dict = {k: {} for k in KINDS}
    for kind, per_n in raw.items():
        for n, times in per_n.items():
            table[kind][str(n)] = fit_alpha_beta(kind, int(n), sizes, times)
    return table


def _cpu_rank_fn(sizes, iters):
    return collective_bench("cpu", sizes, iters)


def _gpu_worker(rank: int, world: int, port: int, sizes, iters, path: str) -> None:
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, device_id=torch.device("cuda", rank))
    try:
        raw = collective_bench("cuda", sizes, iters)
        if rank == 0:
            with open(path, "w") as fh:
                json.dump(raw, fh)
    finally:
        dist.destroy_process_group()


def calibrate(ranks: int | None = None, quick: bool = False, device: str | None = None) -> dict:
    """Measure this machine; returns {"hardware": Hardware dict, "measurements": raw numbers}."""
    import torch

    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    sizes = [2**12, 2**16, 2**20, 2**22] if quick else [2**12, 2**16, 2**20, 2**22, 2**24]
    iters = 3 if quick else 10
    if device == "cuda":
        sizes = [s * 16 for s in sizes]
        ranks = ranks or torch.cuda.device_count()
        n_mm = 8192
        dev_name = torch.cuda.get_device_name(0)
        mem = torch.cuda.get_device_properties(0).total_memory
        overhead = 2 * GiB
    else:
        ranks = ranks or max(2, min(os.cpu_count() or 2, 8))
        n_mm = 512 if quick else 1024
        dev_name = "cpu"
        import psutil

        mem = psutil.virtual_memory().total / ranks
        overhead = 0.25 * GiB
    flops_bf16 = measure_matmul(device, "bfloat16", n_mm)
    flops_fp32 = measure_matmul(device, "float32", n_mm)
    copy_bw = measure_copy_bw(device, 2**26 if quick else 2**28)
    raw: dict = {}
    if ranks >= 2:
        if device == "cuda":
            raw = _run_gpu(ranks, sizes, iters)
        else:
            from ndparallel.runtime.multirank import run_on_ranks

            raw = run_on_ranks(_cpu_rank_fn, ranks, sizes, iters, timeout_s=300)[0]
    table = _fit_all(raw, sizes) if raw else {}
    ar = table.get("all_reduce", {})
    biggest = ar.get(str(max((int(k) for k in ar), default=0)))
    bw = biggest["bus_bw"] if biggest else copy_bw
    alpha = biggest["alpha_s"] if biggest else 5e-6
    hw = Hardware(
        name=f"calibrated-{dev_name}".replace(" ", "-").lower(),
        mem_bytes=float(mem), peak_flops=flops_bf16, peak_flops_fp32=flops_fp32, hbm_bw=copy_bw,
        intra_node_bw=bw, inter_node_bw=bw, intra_node_latency=alpha, inter_node_latency=alpha,
        link_efficiency=1.0, matmul_efficiency=1.0, runtime_overhead_bytes=overhead,
        collectives=table,
    )
    return {
        "hardware": hw.to_dict(),
        "measurements": {
            "device": dev_name, "ranks": ranks, "sizes_bytes": sizes, "iters": iters,
            "matmul_n": n_mm, "matmul_flops": {"bfloat16": flops_bf16, "float32": flops_fp32},
            "copy_bytes_per_s": copy_bw,
            "collective_seconds": {k: {str(n): t for n, t in v.items()} for k, v in raw.items()},
            "note": "inter-node numbers are copies of the intra-node ones (one machine measured)",
        },
    }


def _run_gpu(ranks: int, sizes, iters) -> dict:
    import tempfile

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "raw.json")
        mp.spawn(_gpu_worker, args=(ranks, port, sizes, iters, path), nprocs=ranks, join=True)
        with open(path) as fh:
            return {k: {int(n): t for n, t in v.items()} for k, v in json.load(fh).items()}
