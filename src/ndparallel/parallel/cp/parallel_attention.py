"""Exact causal (and document-masked) attention over a context-parallel group.

Each rank holds its queries, keys and values for the chunks ``cp_chunk_ids(rank)`` of the
sequence (load-balanced: chunks i and 2·cp−1−i). Attention is computed block by block (a query
chunk against a key span) with the kernels of ``attention_kernels`` and the document geometry
of ``attention_blocks``; block results are merged by log-sum-exp in fp32, in place; the backward recomputes
each block from the final output and log-sum-exp, so no score matrix is stored.

Strategies:

* ``ring``: K/V (stacked into one buffer) rotate rank -> rank+1 with ``batch_isend_irecv``; the
  transfer for the next step is posted before the current block's compute and waited after it.
  The backward rotates K/V again and sends the accumulated dK/dV along with them (fp32), so after
  ``cp`` hops each rank holds the gradient of its own K/V (3·cp−2 hops per layer in all: it keeps
  no remote K/V between forward and backward — the memory trade, see docs/context_parallel.md).
  Every rank posts the same transfers at every step whatever blocks it skips (a skipped block must
  not skip a collective: deadlock).
* ``allgather``: K/V gathered once with a functional collective; each local query chunk attends
  to the keys before it (one dense span) and its own chunk (one causal span). The backward
  reduce-scatters dK/dV (fp32). Keeps the gathered K/V for the backward (memory O(S) per rank).
* ``ulysses`` (Ulysses, ``cp/ulysses.py``): heads <-> sequence all-to-all, local attention on
  cp-th of the heads over the whole sequence, all-to-all back.

Packed documents (``position_ids`` restarting at 0): attention never crosses a document start;
blocks wholly in other documents are skipped, partial ones cut into rectangles (``attention_blocks``).
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.distributed as dist

from ndparallel.layout.mesh import process_group
from ndparallel.parallel.cp.attention_blocks import (
    DocLayout,
    accumulators,
    backward_span,
    document_starts,
    forward_span,
)
from ndparallel.parallel.cp.attention_kernels import BlockKernel
from ndparallel.parallel.cp.exchange import (
    all_gather,
    finish,
    reduce_scatter,
    ring_ops,
    start,
)
from ndparallel.parallel.cp.sharding import cp_chunk_ids, cp_positions
from ndparallel.parallel.cp.ulysses import ulysses_attention
from ndparallel.parallel.document_attention import Kernel, check_shapes, make_block_kernel, same_head_dims

Strategy = Literal["ring", "allgather", "ulysses"]
STRATEGIES = ("ring", "allgather", "ulysses")
_KV_TAG, _DKV_TAG = 11, 12


def _chunk(t: torch.Tensor, i: int, n: int) -> torch.Tensor:
    return t[:, :, i * n : (i + 1) * n]


# ----------------------------------------------------------------------------- ring
class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, load_balance, kernel: BlockKernel, docs: DocLayout):
        rank, cp = dist.get_rank(group), dist.get_world_size(group)
        ids = [cp_chunk_ids(r, cp, load_balance) for r in range(cp)]
        n = docs.n
        acc_out, acc_lse = accumulators(q)
        fresh = [True] * len(ids[rank])
        kv = torch.stack([k, v]).contiguous()
        buf = torch.empty_like(kv)
        for step in range(cp):
            src = (rank - step) % cp
            reqs = start(ring_ops([(kv, buf)], group, _KV_TAG) if step < cp - 1 else [])
            for qi in range(len(ids[rank])):
                for kj, c in enumerate(ids[src]):
                    groups = docs.groups(qi, c * n, n)
                    if groups:
                        fresh[qi] = forward_span(
                            kernel,
                            _chunk(q, qi, n),
                            _chunk(kv[0], kj, n),
                            _chunk(kv[1], kj, n),
                            _chunk(acc_out, qi, n),
                            _chunk(acc_lse, qi, n),
                            groups,
                            fresh[qi],
                        )
            finish(reqs)
            if step < cp - 1:
                kv, buf = buf, kv
        out = acc_out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, acc_lse)
        ctx.args = (group, load_balance, kernel, docs)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        group, load_balance, kernel, docs = ctx.args
        rank, cp = dist.get_rank(group), dist.get_world_size(group)
        ids = [cp_chunk_ids(r, cp, load_balance) for r in range(cp)]
        n = docs.n
        dout = dout.contiguous()
        dq = torch.zeros_like(q, dtype=torch.float32)
        kv = torch.stack([k, v]).contiguous()
        buf = torch.empty_like(kv)
        dkv_done = None  # dK/dV of the K/V held at the previous step, complete up to this rank
        dkv_in = torch.empty(kv.shape, dtype=torch.float32, device=kv.device)
        for step in range(cp):
            src = (rank - step) % cp
            ops = ring_ops([(kv, buf)] if step < cp - 1 else [], group, _KV_TAG)
            if step > 0:
                ops += ring_ops([(dkv_done, dkv_in)], group, _DKV_TAG)
            reqs = start(ops)
            contrib = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
            for qi in range(len(ids[rank])):
                for kj, c in enumerate(ids[src]):
                    groups = docs.groups(qi, c * n, n)
                    if groups:
                        backward_span(
                            kernel,
                            _chunk(q, qi, n),
                            _chunk(kv[0], kj, n),
                            _chunk(kv[1], kj, n),
                            _chunk(out, qi, n),
                            _chunk(dout, qi, n),
                            _chunk(lse, qi, n),
                            _chunk(dq, qi, n),
                            _chunk(contrib[0], kj, n),
                            _chunk(contrib[1], kj, n),
                            groups,
                        )
            finish(reqs)
            if step > 0:
                contrib += dkv_in
                dkv_in = dkv_done  # its send is complete: reuse as the next receive buffer
            dkv_done = contrib
            if step < cp - 1:
                kv, buf = buf, kv
        if cp > 1:  # last hop: the gradient of each K/V goes home
            finish(start(ring_ops([(dkv_done, dkv_in)], group, _DKV_TAG)))
            dkv_done = dkv_in
        return (dq.to(q.dtype), dkv_done[0].to(k.dtype), dkv_done[1].to(v.dtype), None, None, None, None)


# ----------------------------------------------------------------------------- all-gather
def _natural_spans(a: int, n: int):
    """(key start, key length) spans of query chunk ``a`` in natural order: its own, then all before."""
    return [(a * n, n)] + ([(0, a * n)] if a > 0 else [])


class _AllGatherAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, load_balance, kernel: BlockKernel, docs: DocLayout):
        cp = dist.get_world_size(group)
        n = docs.n
        kv = torch.stack([k, v]).contiguous()  # [2, B, Hk, S_loc, D]
        g = all_gather(kv, group)
        kv_nat = _to_natural(g.view(cp, *kv.shape), cp, load_balance, n)  # [2, B, Hk, S, D]
        acc_out, acc_lse = accumulators(q)
        for qi, a in enumerate(docs.chunk_ids):
            fresh = True
            for ks, kl in _natural_spans(a, n):
                groups = docs.groups(qi, ks, kl)
                if groups:
                    fresh = forward_span(
                        kernel,
                        _chunk(q, qi, n),
                        kv_nat[0, :, :, ks : ks + kl],
                        kv_nat[1, :, :, ks : ks + kl],
                        _chunk(acc_out, qi, n),
                        _chunk(acc_lse, qi, n),
                        groups,
                        fresh,
                    )
        out = acc_out.to(q.dtype)
        ctx.save_for_backward(q, kv_nat, out, acc_lse)
        ctx.args = (group, load_balance, kernel, docs)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, kv_nat, out, lse = ctx.saved_tensors
        group, load_balance, kernel, docs = ctx.args
        cp, n = dist.get_world_size(group), docs.n
        dout = dout.contiguous()
        dq = torch.zeros_like(q, dtype=torch.float32)
        dkv = torch.zeros(kv_nat.shape, dtype=torch.float32, device=q.device)
        for qi, a in enumerate(docs.chunk_ids):
            for ks, kl in _natural_spans(a, n):
                groups = docs.groups(qi, ks, kl)
                if groups:
                    backward_span(
                        kernel,
                        _chunk(q, qi, n),
                        kv_nat[0, :, :, ks : ks + kl],
                        kv_nat[1, :, :, ks : ks + kl],
                        _chunk(out, qi, n),
                        _chunk(dout, qi, n),
                        _chunk(lse, qi, n),
                        _chunk(dq, qi, n),
                        dkv[0, :, :, ks : ks + kl],
                        dkv[1, :, :, ks : ks + kl],
                        groups,
                    )
        rank_major = _to_rank_major(dkv, cp, load_balance, n)  # [cp, 2, B, Hk, S_loc, D]
        mine = reduce_scatter(rank_major.flatten(0, 1), group)
        return (dq.to(q.dtype), mine[0].to(q.dtype), mine[1].to(q.dtype), None, None, None, None)


def _to_natural(g: torch.Tensor, cp: int, load_balance: bool, n: int) -> torch.Tensor:
    """[cp, 2, B, Hk, S_loc, D] rank-major shards -> [2, B, Hk, S, D] in sequence order."""
    chunks = {}
    for r in range(cp):
        for j, c in enumerate(cp_chunk_ids(r, cp, load_balance)):
            chunks[c] = g[r, :, :, :, j * n : (j + 1) * n]
    return torch.cat([chunks[c] for c in range(len(chunks))], dim=3)


def _to_rank_major(x: torch.Tensor, cp: int, load_balance: bool, n: int) -> torch.Tensor:
    """Inverse of ``_to_natural`` (contiguous)."""
    per_rank = [
        torch.cat([x[:, :, :, c * n : (c + 1) * n] for c in cp_chunk_ids(r, cp, load_balance)], dim=3)
        for r in range(cp)
    ]
    return torch.stack(per_rank).contiguous()


# ----------------------------------------------------------------------------- public ops
def context_parallel_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    group,
    strategy: Strategy = "ring",
    load_balance: bool = True,
    scale: float | None = None,
    kernel: Kernel = "auto",
    position_ids: torch.Tensor | None = None,
    cache=None,
    window: int | None = None,
    chunk: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Causal attention of this rank's queries against the keys of the whole cp group.

    ``query`` [B, H, S_local, D], ``key`` [B, Hk, S_local, D], ``value`` [B, Hk, S_local, Dv]
    with ``H % Hk == 0`` (GQA), all sharded as ``shard_for_cp`` does (same ``load_balance``).
    ``group``: the cp ProcessGroup or a 1-D DeviceMesh. ``position_ids`` [B or 1, S_local]: the
    *global* positions of the local tokens (sharded like the rest); where they restart at 0 a new
    document starts and attention does not cross it. None: plain causal. ``window``, ``chunk``,
    ``softcap``: as in ``document_causal_attention`` (blocks outside every query's window are
    skipped; every rank still takes part in every transfer). ``cache``: a ``DocCache`` shared by
    the layers of one forward. Returns [B, H, S_local, Dv] in ``query``'s dtype. Every rank of the
    group must call it (it communicates in forward and backward).
    """
    group = process_group(group)
    check_shapes(query, key, value)
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy={strategy!r}: use one of {', '.join(STRATEGIES)}")
    rank, cp = dist.get_rank(group), dist.get_world_size(group)
    ids = cp_chunk_ids(rank, cp, load_balance)
    b, s_loc = query.shape[0], query.shape[2]
    if s_loc % len(ids):
        raise ValueError(f"local sequence length {s_loc} must hold {len(ids)} equal chunks")
    block_kernel = make_block_kernel(kernel, query, scale, softcap)
    query, key, value, dv = same_head_dims(query, key, value)
    if strategy == "ulysses":
        return ulysses_attention(
            query, key, value, group, load_balance, block_kernel, position_ids, cache, window, chunk
        )[..., :dv]
    n = s_loc // len(ids)

    def build():
        index = cp_positions(s_loc * cp, rank, cp, load_balance)
        return DocLayout(document_starts(position_ids, index, b, chunk), ids, n, b, query.device, window)

    extra = (b, s_loc, cp, rank, load_balance, window, chunk)
    docs = cache.get(position_ids, extra, build) if cache is not None else build()
    fn = _RingAttention if strategy == "ring" else _AllGatherAttention
    return fn.apply(query, key, value, group, load_balance, block_kernel, docs)[..., :dv]
