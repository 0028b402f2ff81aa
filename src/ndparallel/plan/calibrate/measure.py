"""Measure this machine for the planner: the model's own GEMMs, attention kernels, element-wise
bandwidth, op overheads (``calibrate_kernels.py``) and collective latency/bandwidth per group size
(gloo on forked CPU ranks, NCCL on local GPUs), written as a hardware profile JSON."""

from __future__ import annotations

import json
import os
import socket
import time

from ndparallel.plan.calibrate.kernels import measure_kernels
from ndparallel.plan.hardware import GiB, Hardware, preset_for_device
from ndparallel.plan.models import ModelSpec, load_model_spec
from ndparallel.plan.time.comms import KINDS
from ndparallel.runtime.multirank import run_on_ranks

# Ring-model coefficients of t = k_alpha·α + k_beta·b/B for input bytes b on n ranks.
_COEF = {
    "all_gather": lambda n: (n - 1, n - 1),
    "reduce_scatter": lambda n: (n - 1, (n - 1) / n),
    "all_reduce": lambda n: (2 * (n - 1), 2 * (n - 1) / n),
    "send_recv": lambda n: (1, 1),
    "all_to_all": lambda n: (n - 1, (n - 1) / n),
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
    import torch
    import torch.distributed as dist

    if kind == "all_gather":  # *_single are the torch >= 2.13 names of *_into_tensor / *_tensor
        (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(big, x, group=g)
    elif kind == "reduce_scatter":
        (getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor)(x, big, group=g)
    elif kind == "all_reduce":
        dist.all_reduce(x, group=g)
    elif kind == "all_to_all":
        part = x[: x.numel() // n * n]
        dist.all_to_all_single(torch.empty_like(part), part, group=g)
    else:
        peer_next = (rank + 1) % n
        peer_prev = (rank - 1) % n
        recv = x.clone()
        ops = [
            dist.P2POp(dist.isend, x, peer_next, group=g),
            dist.P2POp(dist.irecv, recv, peer_prev, group=g),
        ]
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
    dist.init_process_group(
        "nccl",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        device_id=torch.device("cuda", rank),
    )
    try:
        raw = collective_bench("cuda", sizes, iters)
        if rank == 0:
            with open(path, "w") as fh:
                json.dump(raw, fh)
    finally:
        dist.destroy_process_group()


def calibrate(
    ranks: int | None = None,
    quick: bool = False,
    device: str | None = None,
    model: ModelSpec | None = None,
    seq_len: int = 2048,
    micro_batch: int = 1,
) -> dict:
    """Measure this machine; returns {"hardware": Hardware dict, "measurements": raw numbers}.

    Kernels (``calibrate_kernels.py``): the bf16 GEMMs of ``model`` at ``seq_len × micro_batch``
    tokens (tp = 1; without ``quick`` also tp = 2, 4, 8 where they divide the heads), causal
    flash attention and the CP ring's block kernels at the model's heads, element-wise bandwidth,
    the cost of one small op. Collectives with ``ranks`` ≥ 2 (NCCL over local GPUs, gloo over
    forked CPU ranks); with one GPU they are not measured and the preset's link figures stay."""
    import torch

    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        ranks = ranks or torch.cuda.device_count()
        dev_name = torch.cuda.get_device_name(0)
        mem = float(torch.cuda.get_device_properties(0).total_memory)
        base = preset_for_device(dev_name)
    else:
        ranks = ranks if ranks is not None else max(2, min(os.cpu_count() or 2, 8))
        dev_name = "cpu"
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / max(ranks, 1)  # physical memory
        base = None
    model = model or (load_model_spec("llama-3.2-1b") if device == "cuda" else load_model_spec("tiny"))
    kern = measure_kernels(device, quick, model, seq_len, micro_batch)
    raw = _collectives(device, ranks, quick)
    table = _fit_all(raw, _sizes(device, quick)) if raw else {}
    hw = _profile(dev_name, device, mem, base, kern, table, model)
    note = (
        "collectives measured on one machine: inter-node numbers copy the intra-node ones"
        if table
        else f"collectives not measured ({ranks} rank(s)): link figures kept from "
        f"{'the ' + base.name + ' preset' if base else 'the memory copy bandwidth'}"
    )
    return {
        "hardware": hw.to_dict(),
        "measurements": {
            "device": dev_name,
            "ranks": ranks,
            "model": model.name,
            "seq_len": seq_len,
            "micro_batch": micro_batch,
            **kern,
            "collective_seconds": {k: {str(n): t for n, t in v.items()} for k, v in raw.items()},
            "note": note,
        },
    }


def _sizes(device: str, quick: bool) -> list[int]:
    sizes = [2**12, 2**16, 2**20, 2**22] if quick else [2**12, 2**16, 2**20, 2**22, 2**24]
    return [x * 16 for x in sizes] if device == "cuda" else sizes


def _collectives(device: str, ranks: int, quick: bool) -> dict:
    """Raw collective timings over ``ranks`` local ranks ({} below 2 ranks)."""
    if ranks < 2:
        return {}
    iters = 3 if quick else 10
    if device == "cuda":
        return _run_gpu(ranks, _sizes(device, quick), iters)

    return run_on_ranks(_cpu_rank_fn, ranks, _sizes(device, quick), iters, timeout_s=300)[0]


def _profile(
    dev_name: str, device: str, mem: float, base: Hardware | None, kern: dict, table: dict, model: ModelSpec
) -> Hardware:
    """The measured numbers as a Hardware profile. A known GPU keeps its preset's spec peaks and
    bandwidth, the measurements becoming efficiencies (so MFU stays against the spec peak); an
    unknown device (CPU) gets the measured rates as its peaks, efficiencies 1."""
    bf16, fp32 = kern["matmul_flops"]["bfloat16"], kern["matmul_flops"]["float32"]
    peak = base.peak_flops if base else bf16
    bw = kern["elementwise"]["stream"]
    a = kern["attention"]
    fwd_flops = 2.0 * a["batch"] * a["heads"] * a["head_dim"] * a["seq"] ** 2
    cp = {}
    for name, blk in kern["cp_blocks"].items():
        flops = 4.0 * blk["batch"] * blk["heads"] * blk["head_dim"] * blk["chunk"] ** 2
        cp[name] = {"fwd": flops / (blk["fwd_s"] * peak), "bwd": 2.5 * flops / (blk["bwd_s"] * peak)}
    small = kern["small_op"]
    links = {}
    if table:
        ar = table.get("all_reduce", {})
        biggest = ar[str(max(int(k) for k in ar))]
        links = dict(
            intra_node_bw=biggest["bus_bw"],
            inter_node_bw=biggest["bus_bw"],
            intra_node_latency=biggest["alpha_s"],
            inter_node_latency=biggest["alpha_s"],
            link_efficiency=1.0,
        )
    elif base:
        links = dict(
            intra_node_bw=base.intra_node_bw,
            inter_node_bw=base.inter_node_bw,
            intra_node_latency=base.intra_node_latency,
            inter_node_latency=base.inter_node_latency,
            link_efficiency=base.link_efficiency,
        )
    else:  # one CPU rank: nothing measured; memory copies as a stand-in
        links = dict(intra_node_bw=bw, inter_node_bw=bw, link_efficiency=1.0)
    return Hardware(
        name=f"calibrated-{dev_name}".replace(" ", "-").lower(),
        mem_bytes=mem,
        peak_flops=peak,
        peak_flops_fp32=base.peak_flops_fp32 if base else fp32,
        hbm_bw=base.hbm_bw if base else bw,
        **links,
        matmul_efficiency=bf16 / peak,
        runtime_overhead_bytes=base.runtime_overhead_bytes if base else 0.25 * GiB,
        hbm_efficiency=bw / base.hbm_bw if base else 1.0,
        broadcast_efficiency=kern["elementwise"]["broadcast"] / bw,
        attention_efficiency={
            **(base.attention_efficiency if base else {}),
            str(a["head_dim"]): [fwd_flops / (a["fwd_s"] * peak), 2 * fwd_flops / (a["bwd_s"] * peak)],
        },
        cp_block_efficiency=cp,
        kernel_overhead_s=small.get("gpu_s", 0.0),
        host_op_s=small["host_s"],
        gemm_table=kern["gemm_table"],
        collectives=table,
    )


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
