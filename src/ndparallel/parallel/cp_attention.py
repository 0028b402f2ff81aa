"""Exact causal attention over a context-parallel group, for load-balanced sequence shards.

Each rank holds its queries, keys and values for the chunks ``cp_chunk_ids(rank)`` of the
sequence. Attention is computed block by block (one query chunk against one key chunk); a block
is *full* when the key chunk precedes the query chunk, *causal* (diagonal) when it is the same
chunk and skipped when it follows it, so masking uses global chunk positions, not local ones.
Partial results are merged by log-sum-exp in fp32; the backward recomputes each block from the
final output and log-sum-exp (flash-attention style), so no score matrix is stored.

Strategies:

* ``ring``: K/V (stacked into one buffer) rotate rank -> rank+1 with ``batch_isend_irecv``; the
  transfer for the next step is posted before the current block's compute and waited after it.
  The backward rotates K/V again and sends the accumulated dK/dV along with them (fp32), so after
  ``cp`` hops each rank holds the gradient of its own K/V. Every rank posts the same transfers at
  every step whatever blocks it skips (a skipped block must not skip a collective: deadlock).
* ``allgather``: K/V gathered once with a functional collective; each local query chunk attends
  to the keys before it (one full block) and its own chunk (one causal block). The backward
  reduce-scatters dK/dV (fp32). Stores the gathered K/V for the backward (memory O(S) per rank).

Kernels: ``math`` (fp32 matmuls, any device), ``sdpa`` (PyTorch's fused flash kernel with
log-sum-exp: ``_scaled_dot_product_flash_attention_for_cpu`` on CPU,
``_scaled_dot_product_efficient_attention`` on CUDA). ``auto`` = ``sdpa`` on CPU, ``math`` on
CUDA until the CUDA path has been checked on a GPU.
"""

from __future__ import annotations

import math
from typing import Literal, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ndparallel.layout.mesh import process_group
from ndparallel.parallel.cp_sharding import cp_chunk_ids

Strategy = Literal["ring", "allgather"]
Kernel = Literal["auto", "math", "sdpa"]
_KV_TAG, _DKV_TAG = 11, 12


# ----------------------------------------------------------------------------- block kernels
def _resolve_kernel(kernel: str, device: torch.device) -> str:
    if kernel == "auto":
        return "sdpa" if device.type == "cpu" else "math"
    if kernel not in ("math", "sdpa"):
        raise ValueError(f"kernel={kernel!r} is not one of 'auto', 'math', 'sdpa'")
    return kernel


def _expand_kv(t: torch.Tensor, groups: int) -> torch.Tensor:
    """[B, Hk, L, D] -> [B, Hk·groups, L, D] (GQA heads repeated, as HF's repeat_kv)."""
    if groups == 1:
        return t
    b, hk, n, d = t.shape
    return t[:, :, None].expand(b, hk, groups, n, d).reshape(b, hk * groups, n, d)


def _fold_kv_grad(g: torch.Tensor, groups: int) -> torch.Tensor:
    if groups == 1:
        return g
    b, h, n, d = g.shape
    return g.view(b, h // groups, groups, n, d).sum(2)


def _scores(q, k, scale, causal):
    """fp32 scores [B, Hk, G, Lq, Lk]; GQA by broadcasting (no repeated K)."""
    b, h, lq, d = q.shape
    hk = k.shape[1]
    s = torch.matmul(q.float().view(b, hk, h // hk, lq, d), k.float().unsqueeze(2).transpose(-1, -2))
    s = s * scale
    if causal:
        mask = torch.ones(lq, k.shape[2], dtype=torch.bool, device=q.device).triu_(1)
        s = s.masked_fill(mask, float("-inf"))
    return s


def _block_fwd(q, k, v, scale: float, causal: bool, kernel: str):
    """One block: (out fp32 [B, H, Lq, Dv], lse fp32 [B, H, Lq])."""
    b, h, lq, _ = q.shape
    groups = h // k.shape[1]
    if kernel == "math":
        s = _scores(q, k, scale, causal)
        lse = torch.logsumexp(s, dim=-1)
        out = torch.matmul(torch.exp(s - lse.unsqueeze(-1)), v.float().unsqueeze(2))
        return out.reshape(b, h, lq, -1), lse.reshape(b, h, lq)
    ke, ve = _expand_kv(k, groups), _expand_kv(v, groups)
    if q.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, ke, ve, 0.0, causal, scale=scale
        )
    else:
        out, lse, _, _ = torch.ops.aten._scaled_dot_product_efficient_attention(
            q, ke, ve, None, True, 0.0, causal, scale=scale
        )
        lse = lse[..., :lq]
    return out.float(), lse.float()


def _block_bwd(q, k, v, out, dout, lse, delta, scale: float, causal: bool, kernel: str):
    """Gradients of one block given the *final* out/lse of its queries: (dq, dk, dv) fp32."""
    b, h, lq, d = q.shape
    hk = k.shape[1]
    groups = h // hk
    if kernel == "math":
        p = torch.exp(_scores(q, k, scale, causal) - lse.view(b, hk, groups, lq, 1))
        do = dout.float().view(b, hk, groups, lq, -1)
        dv = torch.matmul(p.transpose(-1, -2), do).sum(2)
        dp = torch.matmul(do, v.float().unsqueeze(2).transpose(-1, -2))
        ds = p * (dp - delta.view(b, hk, groups, lq, 1))
        dq = torch.matmul(ds, k.float().unsqueeze(2)).reshape(b, h, lq, d) * scale
        dk = torch.matmul(ds.transpose(-1, -2), q.float().view(b, hk, groups, lq, d)).sum(2) * scale
        return dq, dk, dv
    ke, ve = _expand_kv(k, groups), _expand_kv(v, groups)
    if q.device.type == "cpu":
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, ke, ve, out, lse, 0.0, causal, scale=scale
        )
    else:  # mem-efficient kernel; it expects its log-sum-exp padded to a multiple of 32
        lse_p = F.pad(lse, (0, (-lq) % 32))
        zero = torch.zeros((), dtype=torch.int64, device=q.device)
        dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
            dout, q, ke, ve, None, out, lse_p, zero, zero, 0.0, [True, True, True, False], causal,
            scale=scale,
        )
    return dq.float(), _fold_kv_grad(dk.float(), groups), _fold_kv_grad(dv.float(), groups)


def _merge(acc, out, lse):
    """Log-sum-exp merge of a block result into the running (out, lse) of one query chunk."""
    if acc is None:
        return out, lse
    acc_out, acc_lse = acc
    new = torch.logaddexp(acc_lse, lse)
    # -inf - -inf would be NaN: rows with nothing seen yet keep weight 0.
    w_old = torch.exp(torch.where(torch.isinf(acc_lse), acc_lse, acc_lse - new)).unsqueeze(-1)
    w_new = torch.exp(torch.where(torch.isinf(lse), lse, lse - new)).unsqueeze(-1)
    return acc_out * w_old + out * w_new, new


def _pairs(q_ids: Sequence[int], k_ids: Sequence[int]):
    """(q index, k index, causal) of every block that is not fully masked."""
    for qi, a in enumerate(q_ids):
        for kj, c in enumerate(k_ids):
            if c <= a:
                yield qi, kj, c == a


# ----------------------------------------------------------------------------- ring
def _p2p(pairs, group, tag):
    """Ops sending ``send`` to rank+1 and receiving ``recv`` from rank-1 of ``group``."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    nxt = dist.get_global_rank(group, (rank + 1) % size)
    prv = dist.get_global_rank(group, (rank - 1) % size)
    ops = []
    for send, recv in pairs:
        ops.append(dist.P2POp(dist.isend, send, nxt, group, tag))
        ops.append(dist.P2POp(dist.irecv, recv, prv, group, tag))
    return ops


def _start(ops):
    return dist.batch_isend_irecv(ops) if ops else []


def _wait(reqs):
    for r in reqs:
        r.wait()


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, load_balance, scale, kernel):
        rank, cp = dist.get_rank(group), dist.get_world_size(group)
        ids = [cp_chunk_ids(r, cp, load_balance) for r in range(cp)]
        n = q.shape[2] // len(ids[rank])
        qs = q.split(n, dim=2)
        acc = [None] * len(qs)
        kv = torch.stack([k, v]).contiguous()
        buf = torch.empty_like(kv)
        for step in range(cp):
            src = (rank - step) % cp
            reqs = _start(_p2p([(kv, buf)], group, _KV_TAG) if step < cp - 1 else [])
            ks, vs = kv[0].split(n, dim=2), kv[1].split(n, dim=2)
            for qi, kj, causal in _pairs(ids[rank], ids[src]):
                acc[qi] = _merge(acc[qi], *_block_fwd(qs[qi], ks[kj], vs[kj], scale, causal, kernel))
            _wait(reqs)
            if step < cp - 1:
                kv, buf = buf, kv
        out = torch.cat([a[0] for a in acc], dim=2).to(q.dtype)
        lse = torch.cat([a[1] for a in acc], dim=2)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (group, load_balance, scale, kernel)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        group, load_balance, scale, kernel = ctx.args
        rank, cp = dist.get_rank(group), dist.get_world_size(group)
        ids = [cp_chunk_ids(r, cp, load_balance) for r in range(cp)]
        n = q.shape[2] // len(ids[rank])
        dout = dout.contiguous()
        delta = (dout.float() * out.float()).sum(-1)
        qs, outs, douts = q.split(n, 2), out.split(n, 2), dout.split(n, 2)
        lses, deltas = lse.split(n, 2), delta.split(n, 2)
        dq = torch.zeros_like(q, dtype=torch.float32)
        dqs = dq.split(n, 2)
        kv = torch.stack([k, v]).contiguous()
        buf = torch.empty_like(kv)
        dkv_done = None  # dK/dV of the K/V held at the previous step, complete up to this rank
        dkv_in = torch.empty(kv.shape, dtype=torch.float32, device=kv.device)
        for step in range(cp):
            src = (rank - step) % cp
            pairs_kv = [(kv, buf)] if step < cp - 1 else []
            ops = _p2p(pairs_kv, group, _KV_TAG)
            if step > 0:
                ops += _p2p([(dkv_done, dkv_in)], group, _DKV_TAG)
            reqs = _start(ops)
            contrib = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
            ks, vs = kv[0].split(n, 2), kv[1].split(n, 2)
            dks, dvs = contrib[0].split(n, 2), contrib[1].split(n, 2)
            for qi, kj, causal in _pairs(ids[rank], ids[src]):
                g_q, g_k, g_v = _block_bwd(qs[qi], ks[kj], vs[kj], outs[qi], douts[qi], lses[qi],
                                           deltas[qi], scale, causal, kernel)
                dqs[qi].add_(g_q)
                dks[kj].add_(g_k)
                dvs[kj].add_(g_v)
            _wait(reqs)
            if step > 0:
                contrib += dkv_in
                dkv_in = dkv_done  # its send is complete: reuse as the next receive buffer
            dkv_done = contrib
            if step < cp - 1:
                kv, buf = buf, kv
        if cp > 1:  # last hop: the gradient of each K/V goes home
            _wait(_start(_p2p([(dkv_done, dkv_in)], group, _DKV_TAG)))
            dkv_done = dkv_in
        return (dq.to(q.dtype), dkv_done[0].to(k.dtype), dkv_done[1].to(v.dtype),
                None, None, None, None)


# ----------------------------------------------------------------------------- all-gather
class _AllGatherAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, load_balance, scale, kernel):
        import torch.distributed._functional_collectives as funcol

        rank, cp = dist.get_rank(group), dist.get_world_size(group)
        my_ids = cp_chunk_ids(rank, cp, load_balance)
        n = q.shape[2] // len(my_ids)
        kv = torch.stack([k, v]).contiguous()  # [2, B, Hk, S_loc, D]
        g = funcol.all_gather_single(kv, 0, group)
        g = g.wait() if isinstance(g, funcol.AsyncCollectiveTensor) else g
        kv_nat = _to_natural(g.view(cp, *kv.shape), cp, load_balance, n)  # [2, B, Hk, S, D]
        acc = []
        for qi, a in enumerate(my_ids):
            qc = q[:, :, qi * n:(qi + 1) * n]
            res = _block_fwd(qc, kv_nat[0, :, :, a * n:(a + 1) * n], kv_nat[1, :, :, a * n:(a + 1) * n],
                             scale, True, kernel)
            if a > 0:
                res = _merge(res, *_block_fwd(qc, kv_nat[0, :, :, :a * n], kv_nat[1, :, :, :a * n],
                                              scale, False, kernel))
            acc.append(res)
        out = torch.cat([a[0] for a in acc], dim=2).to(q.dtype)
        lse = torch.cat([a[1] for a in acc], dim=2)
        ctx.save_for_backward(q, kv_nat, out, lse)
        ctx.args = (group, load_balance, scale, kernel, n)
        return out

    @staticmethod
    def backward(ctx, dout):
        import torch.distributed._functional_collectives as funcol

        q, kv_nat, out, lse = ctx.saved_tensors
        group, load_balance, scale, kernel, n = ctx.args
        rank, cp = dist.get_rank(group), dist.get_world_size(group)
        dout = dout.contiguous()
        delta = (dout.float() * out.float()).sum(-1)
        dq = torch.zeros_like(q, dtype=torch.float32)
        dkv = torch.zeros(kv_nat.shape, dtype=torch.float32, device=q.device)
        for qi, a in enumerate(cp_chunk_ids(rank, cp, load_balance)):
            sl = slice(qi * n, (qi + 1) * n)
            blocks = [(slice(a * n, (a + 1) * n), True)] + ([(slice(0, a * n), False)] if a > 0 else [])
            for ksl, causal in blocks:
                g_q, g_k, g_v = _block_bwd(q[:, :, sl], kv_nat[0, :, :, ksl], kv_nat[1, :, :, ksl],
                                           out[:, :, sl], dout[:, :, sl], lse[:, :, sl],
                                           delta[:, :, sl], scale, causal, kernel)
                dq[:, :, sl] += g_q
                dkv[0, :, :, ksl] += g_k
                dkv[1, :, :, ksl] += g_v
        rank_major = _to_rank_major(dkv, cp, load_balance, n)  # [cp, 2, B, Hk, S_loc, D]
        mine = funcol.reduce_scatter_single(rank_major.flatten(0, 1), "sum", 0, group)
        mine = mine.wait() if isinstance(mine, funcol.AsyncCollectiveTensor) else mine
        return (dq.to(q.dtype), mine[0].to(q.dtype), mine[1].to(q.dtype), None, None, None, None)


def _to_natural(g: torch.Tensor, cp: int, load_balance: bool, n: int) -> torch.Tensor:
    """[cp, 2, B, Hk, S_loc, D] rank-major shards -> [2, B, Hk, S, D] in sequence order."""
    chunks = {}
    for r in range(cp):
        for j, c in enumerate(cp_chunk_ids(r, cp, load_balance)):
            chunks[c] = g[r, :, :, :, j * n:(j + 1) * n]
    return torch.cat([chunks[c] for c in range(len(chunks))], dim=3)


def _to_rank_major(x: torch.Tensor, cp: int, load_balance: bool, n: int) -> torch.Tensor:
    """Inverse of ``_to_natural`` (contiguous)."""
    per_rank = [
        torch.cat([x[:, :, :, c * n:(c + 1) * n] for c in cp_chunk_ids(r, cp, load_balance)], dim=3)
        for r in range(cp)
    ]
    return torch.stack(per_rank).contiguous()


# ----------------------------------------------------------------------------- public op
def context_parallel_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    group,
    strategy: Strategy = "ring",
    load_balance: bool = True,
    scale: float | None = None,
    kernel: Kernel = "auto",
) -> torch.Tensor:
    """Causal attention of this rank's queries against the keys of the whole cp group.

    ``query`` [B, H, S_local, D], ``key``/``value`` [B, Hk, S_local, D] with ``H % Hk == 0`` (GQA),
    all sharded as ``shard_for_cp`` does (same ``load_balance``). ``group``: the cp ProcessGroup or
    a 1-D DeviceMesh. Returns [B, H, S_local, D] in ``query``'s dtype. Every rank of the group must
    call it (it communicates in forward and backward).
    """
    group = process_group(group)
    if query.dim() != 4 or key.shape != value.shape or key.shape[:1] != query.shape[:1]:
        raise ValueError(f"expected q [B,H,S,D], k/v [B,Hk,S,D]; got {tuple(query.shape)}, "
                         f"{tuple(key.shape)}, {tuple(value.shape)}")
    if query.shape[1] % key.shape[1]:
        raise ValueError(f"num heads {query.shape[1]} is not a multiple of kv heads {key.shape[1]}")
    if query.shape[2] != key.shape[2]:
        raise ValueError("query and key must have the same local sequence length")
    nloc = 2 if load_balance else 1
    if query.shape[2] % nloc:
        raise ValueError(f"local sequence length {query.shape[2]} must hold {nloc} equal chunks")
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else float(scale)
    kernel = _resolve_kernel(kernel, query.device)
    if strategy == "ring":
        fn = _RingAttention
    elif strategy == "allgather":
        fn = _AllGatherAttention
    else:
        raise ValueError(f"strategy={strategy!r}: use 'ring' or 'allgather'")
    return fn.apply(query, key, value, group, load_balance, scale, kernel)
