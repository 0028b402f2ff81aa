"""Kernel micro-benchmarks for ``--calibrate``: the model's own GEMMs, its attention kernels, the
bandwidth of element-wise ops and the cost of one small op (launch + dispatch).

Every function takes a ``device`` ('cuda' or 'cpu'); on CPU the same code runs with small shapes
so the tests exercise it. Times are medians of ``reps`` runs after one warm-up (CUDA events on
the GPU, ``perf_counter`` on CPU).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

from ndparallel.layout.dims import ParallelDims
from ndparallel.parallel.cp.attention_kernels import BlockKernel, resolve_kernel
from ndparallel.plan.settings import Settings
from ndparallel.plan.time.gemm import gemm_shapes


def sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


def time_fn(fn: Callable[[], object], device: str, reps: int = 5, inner: int = 1) -> float:
    """Median seconds of one call of ``fn`` (``inner`` calls per timed run, one warm-up run).
    On CUDA the runs are timed with events and ``inner`` is raised so that a run lasts ≥ ~2 ms:
    the host's launch latency then stays out of a kernel's time."""
    fn()
    sync(device)
    if device.startswith("cuda"):
        import torch

        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        inner = max(inner, min(50, int(2.0 / max(start.elapsed_time(end), 1e-3)) + 1))
        out = []
        for _ in range(reps):
            start.record()
            for _ in range(inner):
                fn()
            end.record()
            torch.cuda.synchronize()
            out.append(start.elapsed_time(end) / 1e3 / inner)
        return statistics.median(out)
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        out.append((time.perf_counter() - t0) / inner)
    return statistics.median(out)


def measure_gemm(device: str, m: int, n: int, k: int, dtype_name: str = "bfloat16", reps: int = 5) -> float:
    """FLOP/s of ``[m, k] @ [k, n]`` in ``dtype_name`` (2·m·n·k FLOPs per call)."""
    import torch

    dtype = getattr(torch, dtype_name)
    a = torch.randn(m, k, device=device, dtype=dtype)
    b = torch.randn(k, n, device=device, dtype=dtype)
    sec = time_fn(lambda: a @ b, device, reps)
    return 2.0 * m * n * k / sec


def measure_gemm_table(device: str, shapes: list[tuple[int, int, int]], reps: int = 5) -> list[dict]:
    """[{m, n, k, flops_per_s}] for each distinct (m, n, k), bf16 (the compute dtype)."""
    rows = []
    for m, n, k in sorted(set(shapes)):
        rows.append({"m": m, "n": n, "k": k, "flops_per_s": measure_gemm(device, m, n, k, reps=reps)})
    return rows


def measure_attention(
    device: str, batch: int, heads: int, kv_heads: int, seq: int, head_dim: int, reps: int = 5
) -> dict:
    """Causal SDPA (the kernel the non-CP path runs: flash on CUDA) forward and backward seconds,
    GQA without repeated K/V, bf16 on CUDA (fp32 on CPU)."""
    import torch
    import torch.nn.functional as F

    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    q = torch.randn(batch, heads, seq, head_dim, device=device, dtype=dtype, requires_grad=True)
    k = torch.randn(batch, kv_heads, seq, head_dim, device=device, dtype=dtype, requires_grad=True)
    v = torch.randn_like(k, requires_grad=True)
    gqa = heads != kv_heads

    def fwd():
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)

    t_fwd = time_fn(fwd, device, reps)
    dout = torch.randn(batch, heads, seq, head_dim, device=device, dtype=dtype)

    def fwd_bwd():
        fwd().backward(dout)

    t_both = time_fn(fwd_bwd, device, reps)
    return {
        "batch": batch,
        "heads": heads,
        "kv_heads": kv_heads,
        "seq": seq,
        "head_dim": head_dim,
        "fwd_s": t_fwd,
        "bwd_s": max(t_both - t_fwd, 1e-9),
    }


def measure_cp_block(
    device: str, kernel: str, batch: int, heads: int, kv_heads: int, chunk: int, head_dim: int, reps: int = 3
) -> dict:
    """One *full* (unmasked) block of the CP block kernel (``parallel/cp/attention_kernels.py``):
    forward (out, lse) and backward seconds for ``chunk`` queries against ``chunk`` keys."""
    import torch

    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    q = torch.randn(batch, heads, chunk, head_dim, device=device, dtype=dtype)
    k = torch.randn(batch, kv_heads, chunk, head_dim, device=device, dtype=dtype)
    v = torch.randn_like(k)
    block = BlockKernel(resolve_kernel(kernel, q), head_dim**-0.5)
    out, lse = block.fwd(q, k, v, False)
    out = out.to(dtype)
    dout = torch.randn_like(q)
    t_fwd = time_fn(lambda: block.fwd(q, k, v, False), device, reps)
    t_bwd = time_fn(lambda: block.bwd(dout, q, k, v, out, lse, False), device, reps)
    return {
        "kernel": kernel,
        "batch": batch,
        "heads": heads,
        "kv_heads": kv_heads,
        "chunk": chunk,
        "head_dim": head_dim,
        "fwd_s": t_fwd,
        "bwd_s": t_bwd,
    }


def measure_elementwise_bw(device: str, nbytes: int, reps: int = 5) -> dict:
    """Bytes/s (read + written) of the kinds of element-wise kernel a training step runs, on
    tensors of about ``nbytes``: contiguous bf16 ``add`` and ``silu``, fp32 -> bf16 casts through
    the vectorized and the unaligned (unrolled) copy kernels, a row-wise fp32 log-softmax, a
    foreach list op (the optimizer's kernels), and two broadcast multiplies (RoPE's ``q·cos`` on
    the transposed head layout, the per-token ``x·rsqrt``). ``stream`` is the harmonic mean of the
    non-broadcast ones (the step's mix), ``broadcast`` that of the broadcast ones."""
    import torch

    low = torch.bfloat16 if device.startswith("cuda") else torch.float32
    es = torch.tensor([], dtype=low).element_size()
    n = max(nbytes // es, 4096)
    x, y = (torch.randn(n, device=device, dtype=low) for _ in range(2))
    out = torch.empty_like(x)
    x32 = torch.randn(n, device=device, dtype=torch.float32)
    rows = max(n // 32768, 1)
    logits = torch.randn(rows, 32768, device=device, dtype=torch.float32)
    lst = [t.view(-1) for t in torch.randn(n, device=device).chunk(64)]
    heads, d = 32, 64
    tok = max(n // (heads * d), 1)
    q = torch.randn(1, tok, heads, d, device=device, dtype=low).transpose(1, 2)
    cos = torch.randn(1, 1, tok, d, device=device, dtype=low)
    xr = torch.randn(tok, heads * d, device=device, dtype=torch.float32)
    rstd = torch.randn(tok, 1, device=device, dtype=torch.float32)
    ops = {
        "add": (lambda: torch.add(x, y, out=out), 3 * n * es),
        "silu": (lambda: torch.nn.functional.silu(x), 2 * n * es),
        "cast": (lambda: out.copy_(x32), n * (4 + es)),
        "cast_unaligned": (lambda: out[1:].copy_(x32[:-1]), n * (4 + es)),
        "log_softmax": (lambda: torch.log_softmax(logits, -1), 12 * logits.numel()),
        "foreach": (lambda: torch._foreach_mul_(lst, 0.5), 8 * n),
        "broadcast_rope": (lambda: q * cos, 2 * q.numel() * es),
        "broadcast_rstd": (lambda: xr * rstd, 8 * xr.numel()),
    }
    res = {name: moved / time_fn(fn, device, reps) for name, (fn, moved) in ops.items()}

    def hmean(vals):
        return len(vals) / sum(1 / v for v in vals)

    res["stream"] = hmean([v for k, v in res.items() if not k.startswith("broadcast")])
    res["broadcast"] = hmean([res["broadcast_rope"], res["broadcast_rstd"]])
    res["bytes"] = nbytes
    return res


def measure_small_op(device: str, ops: int = 2000) -> dict:
    """Per tiny op in a long eager chain: ``host_s`` (the larger of dispatch and launch cost: what
    an eager op costs the host), and on CUDA ``gpu_s``, the same ops replayed as a CUDA graph
    (no host work: the GPU's own cost per back-to-back kernel)."""
    import torch

    x = torch.zeros(16, device=device)

    def chain():
        for _ in range(ops):
            x.add_(1.0)

    out = {"host_s": time_fn(chain, device, reps=3) / ops}
    if device.startswith("cuda"):
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            chain()  # warm-up on a side stream, as graph capture wants
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            chain()
        out["gpu_s"] = time_fn(graph.replay, device, reps=3) / ops
    return out


CPU_MAX_GEMM = 2**27
"""On CPU only GEMMs up to this m·n·k are timed (the tests' tiny shapes; a 1B model's would take
minutes): the others use the curve scaled by the nearest measured shape."""


def measure_kernels(device: str, quick: bool, model, seq_len: int, micro_batch: int) -> dict:
    """Everything ``calibrate`` measures on one device for ``model`` at ``seq_len × micro_batch``."""

    cuda = device.startswith("cuda")
    s = Settings(sequence_len=seq_len, micro_batch_size=micro_batch)
    tps = (
        [1]
        if quick
        else [
            t for t in (1, 2, 4, 8) if not (model.heads % t or model.kv_heads % t or model.intermediate % t)
        ]
    )
    shapes = {sh for t in tps for sh in gemm_shapes(model, ParallelDims(tp=t), s)}
    if not cuda:
        shapes = {sh for sh in shapes if sh[0] * sh[1] * sh[2] <= CPU_MAX_GEMM}
    anchor = 8192 if cuda else 256
    reps = 3 if quick else 5
    seq = seq_len if cuda else min(seq_len, 256)
    chunk = max(seq // 4, 16)
    cp_blocks = {}
    for kernel in ("math", "flash"):
        cp_blocks[kernel] = measure_cp_block(
            device, kernel, micro_batch, model.heads, model.kv_heads, chunk, model.head_dim
        )
    return {
        "anchor_n": anchor,
        "matmul_flops": {
            "bfloat16": measure_gemm(device, anchor, anchor, anchor, reps=reps),
            "float32": measure_gemm(device, anchor, anchor, anchor, "float32", reps=reps),
        },
        "gemm_table": measure_gemm_table(device, sorted(shapes), reps=reps),
        "attention": measure_attention(
            device, micro_batch, model.heads, model.kv_heads, seq, model.head_dim, reps=reps
        ),
        "cp_blocks": cp_blocks,
        "elementwise": measure_elementwise_bw(device, 2**30 if cuda else 2**22, reps=reps),
        "small_op": measure_small_op(device, 2000 if cuda else 200),
    }
