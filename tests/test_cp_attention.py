"""The CP attention op alone vs full causal attention (outputs, dQ, dK, dV), with and without
packed documents, for every strategy; the one-device document attention; sharding helpers."""

import pytest
import torch

from ndparallel.parallel.cp.sharding import (
    cp_chunk_ids,
    cp_positions,
    pad_for_cp,
    reorder_cp_chunks,
    shard_for_cp,
)
from ndparallel.testing import run_on_ranks

TOL = 1e-5  # relative to the largest reference value; measured ~1e-7 .. 7e-7


def packed_positions(batch: int, seq: int, seed: int) -> torch.Tensor:
    """Position ids of packed rows (restarting at 0 at each document start): row 0 has a document
    start at seq/4 (a chunk boundary at cp=2) and one inside a chunk, the other rows random ones."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for b in range(batch):
        starts = (
            {0, seq // 4, seq // 4 + 3} if b == 0 else {0, *torch.randint(1, seq, (3,), generator=g).tolist()}
        )
        pos, cur = [], 0
        for i in range(seq):
            cur = 0 if i in starts else cur + 1
            pos.append(cur)
        rows.append(pos)
    return torch.tensor(rows)


def reference_attention(q, k, v, scale, position_ids=None):
    """fp64 SDPA with an explicit dense mask: key j visible to query i iff start(i) <= j <= i, where
    start(i) = i - position_ids[i] (clamped to [0, i]); no position ids: plain causal."""
    groups = q.shape[1] // k.shape[1]
    q, k, v = (t.double().detach().requires_grad_() for t in (q, k, v))
    s = q.shape[2]
    i = torch.arange(s).view(s, 1)
    j = torch.arange(s).view(1, s)
    if position_ids is None:
        mask = (j <= i).expand(q.shape[0], 1, s, s)
    else:
        start = torch.minimum((torch.arange(s) - position_ids).clamp(min=0), torch.arange(s))
        mask = ((j <= i) & (j >= start.view(-1, s, 1))).unsqueeze(1)
    out = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1), attn_mask=mask, scale=scale
    )
    return q, k, v, out


def _op_errors(strategy, cases):
    """On each rank: run every (kernel, load_balance, heads, kv_heads, seq, padded_to, docs) case."""
    import torch.distributed as dist

    from ndparallel.parallel.cp.parallel_attention import context_parallel_attention
    from ndparallel.parallel.cp.sharding import unshard_from_cp

    rank, cp = dist.get_rank(), dist.get_world_size()
    results = []
    for kernel, lb, heads, kv_heads, seq, padded, docs in cases:
        g = torch.Generator().manual_seed(seq * 10 + heads)
        B, D, scale = 2, 8, 0.3
        q = torch.randn(B, heads, seq, D, generator=g)
        k, v = (torch.randn(B, kv_heads, seq, D, generator=g) for _ in range(2))
        dout = torch.randn(B, heads, seq, D, generator=g)
        pos = packed_positions(B, seq, seq) if docs else torch.arange(seq).expand(B, seq)
        rq, rk, rv, ref = reference_attention(q, k, v, scale, pos if docs else None)
        ref.backward(dout.double())
        # Pad the sequence at the end (random K/V/Q there, zero output gradient: ignored tokens,
        # positions continuing as pad_for_cp writes them).
        pad = padded - seq
        qp, kp, vp = (
            torch.cat([t, torch.randn(B, h, pad, D, generator=g)], dim=2)
            for t, h in ((q, heads), (k, kv_heads), (v, kv_heads))
        )
        dp = torch.cat([dout, torch.zeros(B, heads, pad, D)], dim=2)
        posp = torch.cat([pos, pos[:, -1:] + torch.arange(1, pad + 1)], dim=1)
        ql, kl, vl = (shard_for_cp(t, 2, rank, cp, lb).requires_grad_() for t in (qp, kp, vp))
        out = context_parallel_attention(
            ql,
            kl,
            vl,
            dist.group.WORLD,
            strategy=strategy,
            load_balance=lb,
            scale=scale,
            kernel=kernel,
            position_ids=shard_for_cp(posp, 1, rank, cp, lb),
        )
        out.backward(shard_for_cp(dp, 2, rank, cp, lb))
        errs = {}
        for name, local, full in (
            ("out", out.detach(), ref.detach()),
            ("dq", ql.grad, rq.grad),
            ("dk", kl.grad, rk.grad),
            ("dv", vl.grad, rv.grad),
        ):
            got = unshard_from_cp(local.contiguous(), 2, dist.group.WORLD, lb)[:, :, :seq].double()
            errs[name] = ((got - full).abs().max() / full.abs().max()).item()
        results.append(((kernel, lb, heads, kv_heads, seq, docs), errs))
    return results


CASES = [  # kernel, load_balance, heads, kv_heads (GQA when < heads), seq, padded seq, documents
    ("math", True, 4, 2, 32, 32, False),
    ("flash", True, 4, 2, 32, 32, False),
    ("math", True, 4, 4, 16, 16, False),
    ("flash", True, 4, 1, 29, 32, False),  # odd length, padded to a multiple of 2·cp
    ("math", True, 4, 2, 27, 32, False),
    ("math", False, 4, 2, 24, 24, False),  # contiguous (not load-balanced) shards
    ("math", True, 4, 2, 32, 32, True),  # packed documents, rows with different boundaries
    ("flash", True, 4, 1, 30, 32, True),
    ("flash", False, 4, 4, 24, 24, True),
]


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("strategy", ["ring", "allgather", "ulysses"])
def test_cp_attention_matches_full_causal_attention(cp, strategy):
    for case, errs in run_on_ranks(_op_errors, cp, strategy, CASES, timeout_s=120)[0]:
        assert max(errs.values()) <= TOL, (case, errs)


def _document_mask_matters():
    """Negative control: the same packed inputs without position ids (plain causal) differ."""
    import torch.distributed as dist

    from ndparallel.parallel.cp.parallel_attention import context_parallel_attention

    rank, cp = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 16, 8, generator=g) for _ in range(3))
    pos = packed_positions(1, 16, 0)
    _, _, _, ref = reference_attention(q, k, v, 0.3, pos)
    ql, kl, vl = (shard_for_cp(t, 2, rank, cp) for t in (q, k, v))
    out = context_parallel_attention(ql, kl, vl, dist.group.WORLD, scale=0.3)  # no position ids
    return (out.double() - shard_for_cp(ref.detach(), 2, rank, cp)).abs().max().item()


def test_document_mask_negative_control():
    assert max(run_on_ranks(_document_mask_matters, 2, timeout_s=60)) > 1e-2


@pytest.mark.parametrize("kernel", ["math", "flash"])
@pytest.mark.parametrize("docs", [False, "packed", True])
def test_document_causal_attention_one_device(kernel, docs):
    """No documents and packed rows (every block a causal square: written in place, no fp32
    accumulator), and a row with a jump (merged blocks, the fp32 path)."""
    from ndparallel.parallel.document_attention import document_causal_attention

    g = torch.Generator().manual_seed(3)
    q = torch.randn(3, 4, 20, 8, generator=g)
    k, v = (torch.randn(3, 2, 20, 8, generator=g) for _ in range(2))
    dout = torch.randn(3, 4, 20, 8, generator=g)
    pos = packed_positions(3, 20, 5) if docs else None
    if docs is True:  # a jump without a restart: those queries see back to the row's start (the rule)
        pos[2] = torch.tensor([0, 1, 2, 0, 1, 7, 8, 9, 10, 11, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9])
    rq, rk, rv, ref = reference_attention(q, k, v, 0.3, pos)
    ref.backward(dout.double())
    ql, kl, vl = (t.clone().requires_grad_() for t in (q, k, v))
    out = document_causal_attention(ql, kl, vl, pos, scale=0.3, kernel=kernel)
    out.backward(dout)
    for got, want in ((out, ref), (ql.grad, rq.grad), (kl.grad, rk.grad), (vl.grad, rv.grad)):
        assert ((got.double() - want).abs().max() / want.abs().max()).item() <= TOL


def _never_skips_collectives():
    """cp=2, seq of 4 chunks: rank 0's first chunk attends to nothing remote; must not hang."""
    import torch.distributed as dist

    from ndparallel.parallel.cp.parallel_attention import context_parallel_attention

    q = torch.randn(1, 2, 4, 4, requires_grad=True)
    k = torch.randn(1, 2, 4, 4, requires_grad=True)
    v = torch.randn(1, 2, 4, 4, requires_grad=True)
    for strategy in ("ring", "allgather", "ulysses"):
        for _ in range(2):
            out = context_parallel_attention(q, k, v, dist.group.WORLD, strategy=strategy)
            out.sum().backward()
    return True


def test_cp_attention_backward_does_not_deadlock():
    assert run_on_ranks(_never_skips_collectives, 2, timeout_s=60) == [True, True]


def test_shard_layout_and_inverse():
    x = torch.arange(2 * 16).view(2, 16)
    assert shard_for_cp(x, 1, 0, 2)[0].tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert shard_for_cp(x, 1, 1, 2)[0].tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    assert cp_chunk_ids(1, 4) == (1, 6)
    assert cp_positions(16, 3, 4).tolist() == [6, 7, 8, 9]
    for cp in (1, 2, 4):
        for lb in (True, False):
            shards = torch.cat([shard_for_cp(x, 1, r, cp, lb) for r in range(cp)], dim=1)
            assert torch.equal(reorder_cp_chunks(shards, 1, cp, lb), x)
    with pytest.raises(ValueError, match="pad_for_cp"):
        shard_for_cp(torch.zeros(1, 10), 1, 0, 4)


def test_pad_for_cp():
    batch = {
        "input_ids": torch.arange(10).view(2, 5),
        "shift_labels": torch.arange(10).view(2, 5),
        "position_ids": torch.arange(5).expand(2, 5),
        "meta": "kept",
    }
    out = pad_for_cp(batch, cp_size=2, pad_token_id=0)
    assert out["input_ids"].shape == (2, 8) and out["input_ids"][0].tolist() == [0, 1, 2, 3, 4, 0, 0, 0]
    assert out["shift_labels"][1].tolist() == [5, 6, 7, 8, 9, -100, -100, -100]
    assert out["position_ids"][0].tolist() == list(range(8))
    assert out["meta"] == "kept"
    assert pad_for_cp(batch, cp_size=1, pad_token_id=0, load_balance=False)["input_ids"] is batch["input_ids"]
    with pytest.raises(ValueError, match="extra_pad_values"):
        pad_for_cp({**batch, "token_type_ids": torch.zeros(2, 5)}, cp_size=2, pad_token_id=0)
