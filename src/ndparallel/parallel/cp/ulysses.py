"""Ulysses context parallelism (``cp_comm_strategy: ulysses``).

An all-to-all turns this rank's sequence shard of *all* heads into the *whole* sequence of a
cp-th of the heads; each rank then runs document-masked causal attention locally
(``attention_blocks.local_attention``); a second all-to-all turns the output back into sequence
shards. Autograd runs the mirror all-to-alls in backward (functional collectives with autograd).

Per layer and micro-batch: forward one all-to-all of Q, K and V packed in one buffer
(B·S_local·(H + 2·Hk')·D elements per rank) and one of the output (B·S_local·H·D), plus an
all-gather of the int32 position ids (B·S_local·4 bytes, for the document masks); backward the two
all-to-alls again. Traffic per rank falls as 1/cp; the attention itself is local and can use any
kernel, but cp is bounded by the head counts:

* query heads (per TP rank) divisible by cp;
* K/V heads (per TP rank) divisible by cp, or a divisor of cp: then every K/V head is sent
  cp/Hk times (``Hk' = cp``), so each rank gets the one its query heads use.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from ndparallel.parallel.cp.attention_blocks import DocLayout, document_starts, local_attention
from ndparallel.parallel.cp.attention_kernels import BlockKernel
from ndparallel.parallel.cp.exchange import all_gather, wait
from ndparallel.parallel.cp.sharding import cp_chunk_ids


def ulysses_head_error(heads: int, kv_heads: int, cp: int) -> str | None:
    """Why ``ulysses`` cannot split these heads (per TP rank) over cp ranks; None if it can."""
    if heads % cp:
        return (
            f"{heads} attention heads (per tensor-parallel rank) are not divisible by "
            f"context_parallel_size={cp}"
        )
    if kv_heads % cp and cp % kv_heads:
        return (
            f"{kv_heads} key/value heads (per tensor-parallel rank) neither divide nor are "
            f"divisible by context_parallel_size={cp}"
        )
    return None


def _orders(cp: int, load_balance: bool, device):
    """(rank_major, natural): rank_major[p] = chunk at rank-major position p; natural[c] = the
    rank-major position of chunk c."""
    rank_major = [c for r in range(cp) for c in cp_chunk_ids(r, cp, load_balance)]
    natural = [rank_major.index(c) for c in range(len(rank_major))]
    return (torch.tensor(rank_major, device=device), torch.tensor(natural, device=device))


def _to_heads(x: torch.Tensor, group, natural: torch.Tensor, n: int) -> torch.Tensor:
    """[B, cp, h, S_local, D] (head groups by destination) -> [B, h, S, D], sequence in order."""
    b, cp, h, s_loc, d = x.shape
    recv = wait(funcol.all_to_all_single_autograd(x.transpose(0, 1).contiguous(), None, None, group))
    recv = recv.view(cp, b, h, s_loc // n, n, d).permute(1, 2, 0, 3, 4, 5).reshape(b, h, -1, n, d)
    return recv.index_select(2, natural).reshape(b, h, cp * s_loc, d)


def _to_sequence(o: torch.Tensor, group, rank_major: torch.Tensor, cp: int, n: int) -> torch.Tensor:
    """[B, h, S, D] -> [B, cp·h, S_local, D]: this rank's sequence shard of all heads."""
    b, h, s, d = o.shape
    send = o.reshape(b, h, s // n, n, d).index_select(2, rank_major)
    send = send.reshape(b, h, cp, s // cp, d).permute(2, 0, 1, 3, 4).contiguous()
    recv = wait(funcol.all_to_all_single_autograd(send, None, None, group))
    return recv.permute(1, 0, 2, 3, 4).reshape(b, cp * h, s // cp, d)


def _full_positions(position_ids, b: int, group, natural: torch.Tensor, n: int) -> torch.Tensor:
    """All-gather the position ids of the cp group and put them in sequence order: [B, S]."""
    pos = position_ids.expand(b, -1).to(torch.int32).contiguous()
    cp, s_loc = dist.get_world_size(group), pos.shape[1]
    g = all_gather(pos, group)
    g = g.view(cp, b, s_loc // n, n).permute(1, 0, 2, 3).reshape(b, -1, n)
    return g.index_select(1, natural).reshape(b, cp * s_loc)


def ulysses_attention(
    q,
    k,
    v,
    group,
    load_balance: bool,
    kernel: BlockKernel,
    position_ids=None,
    cache=None,
    window: int | None = None,
    chunk: int | None = None,
) -> torch.Tensor:
    """Context-parallel attention by head/sequence all-to-all; same contract as
    ``context_parallel_attention`` (q [B, H, S_local, D], k/v [B, Hk, S_local, D])."""
    cp = dist.get_world_size(group)
    b, heads, s_loc, d = q.shape
    kv_heads = k.shape[1]
    error = ulysses_head_error(heads, kv_heads, cp)
    if error:
        raise ValueError(f"cp_comm_strategy='ulysses': {error}; use 'ring' or 'allgather'")
    if kv_heads < cp:  # each rank needs the K/V head its query heads use
        k, v = k.repeat_interleave(cp // kv_heads, 1), v.repeat_interleave(cp // kv_heads, 1)
    hq, hk = heads // cp, k.shape[1] // cp
    n = s_loc // (2 if load_balance else 1)
    rank_major, natural = _orders(cp, load_balance, q.device)
    full_pos = None
    if position_ids is not None:  # every call, on every rank: a collective is never skipped
        full_pos = _full_positions(position_ids, b, group, natural.to(position_ids.device), n)

    def build():
        starts = document_starts(full_pos, torch.arange(cp * s_loc), b, chunk)
        return DocLayout(starts, (0,), cp * s_loc, b, q.device, window)

    extra = ("ulysses", b, s_loc, cp, window, chunk)
    docs = cache.get(position_ids, extra, build) if cache is not None else build()
    packed = torch.cat([t.reshape(b, cp, -1, s_loc, d) for t in (q, k, v)], dim=2)
    x = _to_heads(packed, group, natural, n)  # [B, hq + 2·hk, S, D]
    out = local_attention(x[:, :hq], x[:, hq : hq + hk], x[:, hq + hk :], kernel, docs)
    return _to_sequence(out, group, rank_major, cp, n)
