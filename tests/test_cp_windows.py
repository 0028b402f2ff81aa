"""The attention features some families need, in ndparallel's own attention (one device and every
CP strategy), against a dense fp64 reference with an explicit mask: sliding windows (Mistral,
Gemma 2/3, Cohere 2, ...), chunked attention (Llama 4), soft-capped scores (Gemma 2) and a value
head dim that differs from the query/key one (MLA: DeepSeek-V3). Packed documents throughout."""

import pytest
import torch

from ndparallel.testing import run_on_ranks

TOL = 1e-5


def positions(batch: int, seq: int, seed: int) -> torch.Tensor:
    """Packed rows: row 0 one long document, the others 1-4 documents of random lengths."""
    g = torch.Generator().manual_seed(seed)
    out = torch.arange(seq).repeat(batch, 1)
    for r in range(1, batch):
        cuts = sorted(torch.randperm(seq - 1, generator=g)[: r % 4].add(1).tolist())
        for a, b in zip([0, *cuts], [*cuts, seq]):
            out[r, a:b] = torch.arange(b - a)
    return out


def reference(q, k, v, pos, scale, window=None, chunk=None, softcap=None):
    """fp64 attention with the mask written out: key j visible to query i iff lo(i) <= j <= i,
    lo(i) = max(document start, i - window + 1, chunk start); chunks are counted in positions
    within a document (transformers' chunked mask on packed rows)."""
    q, k, v = (t.double().detach().requires_grad_() for t in (q, k, v))
    s, groups = q.shape[2], q.shape[1] // k.shape[1]
    i = torch.arange(s)
    lo = torch.minimum((i - pos).clamp(min=0), i)
    if window is not None:
        lo = torch.maximum(lo, i - window + 1)
    if chunk is not None:
        lo = torch.maximum(lo, i - pos % chunk)
    mask = (i.view(1, 1, s) <= i.view(1, s, 1)) & (i.view(1, 1, s) >= lo.view(-1, s, 1))
    scores = q @ k.repeat_interleave(groups, 1).transpose(-1, -2) * scale
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask.unsqueeze(1), float("-inf"))
    out = torch.softmax(scores, -1) @ v.repeat_interleave(groups, 1)
    return (q, k, v), out


def _errors(pairs) -> list[float]:
    """Largest error of each (got, want) pair relative to the largest reference value of that tensor.

    A window of 1 makes dQ and dK exactly zero (a softmax over one key is constant), so their own
    scale is 0 and the kernel's fp32 residue of the cancelling terms P * (dP - rowsum(dO * O)) is
    all that is left: such a tensor (zero to fp64 rounding) is measured against the case's scale, the
    largest reference value of the output and its gradients (dV = dO there), which is the magnitude
    of the terms that cancel."""
    wants = [want.abs().max().item() for _, want in pairs]
    case_scale = max(wants)
    return [
        ((got.double() - want).abs().max() / (w if w > 1e-9 * case_scale else case_scale)).item()
        for (got, want), w in zip(pairs, wants)
    ]


def _inputs(seq, dv=8, seed=0, batch=3):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, 4, seq, 8, generator=g)
    k = torch.randn(batch, 2, seq, 8, generator=g)
    v = torch.randn(batch, 2, seq, dv, generator=g)
    return q, k, v, torch.randn(batch, 4, seq, dv, generator=g), positions(batch, seq, seed)


# (window, chunk, softcap, value head dim): windows shorter and longer than a CP chunk, W = 1
FEATURES = [
    (5, None, None, 8),
    (1, None, None, 8),
    (11, None, None, 8),
    (64, None, None, 8),
    (None, 6, None, 8),
    (None, None, 2.0, 8),
    (7, None, 2.0, 8),
    (None, None, None, 6),
    (3, None, None, 12),
]


@pytest.mark.parametrize("kernel", ["auto", "math"])  # auto: flash, math where soft-capped
def test_one_device(kernel):
    from ndparallel.parallel.document_attention import document_causal_attention

    for window, chunk, softcap, dv in FEATURES:
        q, k, v, dout, pos = _inputs(24, dv)
        ref_in, ref = reference(q, k, v, pos, 0.3, window, chunk, softcap)
        ref.backward(dout.double())
        got_in = [t.clone().requires_grad_() for t in (q, k, v)]
        out = document_causal_attention(
            *got_in, pos, scale=0.3, kernel=kernel, window=window, chunk=chunk, softcap=softcap
        )
        out.backward(dout)
        pairs = [(out, ref), *((a.grad, b.grad) for a, b in zip(got_in, ref_in))]
        for err in _errors(pairs):
            assert err <= TOL, (window, chunk, softcap, dv, err)


def _cp_errors(strategy):
    import torch.distributed as dist

    from ndparallel.parallel.cp.parallel_attention import context_parallel_attention
    from ndparallel.parallel.cp.sharding import shard_for_cp, unshard_from_cp

    rank, cp = dist.get_rank(), dist.get_world_size()
    worst = {}
    for window, chunk, softcap, dv in FEATURES:
        for lb in (True, False):
            q, k, v, dout, pos = _inputs(32, dv, seed=window or 0)
            ref_in, ref = reference(q, k, v, pos, 0.3, window, chunk, softcap)
            ref.backward(dout.double())
            local = [shard_for_cp(t, 2, rank, cp, lb).requires_grad_() for t in (q, k, v)]
            out = context_parallel_attention(
                *local,
                dist.group.WORLD,
                strategy=strategy,
                load_balance=lb,
                scale=0.3,
                position_ids=shard_for_cp(pos, 1, rank, cp, lb),
                window=window,
                chunk=chunk,
                softcap=softcap,
            )
            out.backward(shard_for_cp(dout, 2, rank, cp, lb))
            pairs = [
                (unshard_from_cp(got.contiguous(), 2, dist.group.WORLD, lb), want)
                for got, want in ((out.detach(), ref), *((a.grad, b.grad) for a, b in zip(local, ref_in)))
            ]
            key = (window, chunk, softcap, dv, lb)
            worst[key] = max(worst.get(key, 0.0), *_errors(pairs))
    return worst


@pytest.mark.parametrize("cp,strategy", [(2, "ring"), (2, "allgather"), (2, "ulysses"), (4, "ring")])
def test_context_parallel(cp, strategy):
    for case, err in run_on_ranks(_cp_errors, cp, strategy, timeout_s=300)[0].items():
        assert err <= TOL, (strategy, case, err)


def test_window_is_not_vacuous():
    """Negative control: the window changes the result (so the tests above can fail)."""
    from ndparallel.parallel.document_attention import document_causal_attention

    q, k, v, _, pos = _inputs(24)
    with_window = document_causal_attention(q, k, v, pos, scale=0.3, window=5)
    assert (with_window - document_causal_attention(q, k, v, pos, scale=0.3)).abs().max() > 1e-2


def test_window_skips_blocks_outside_it():
    """Queries 24..31 with a window of 4 see keys 21..31 only: against keys 0..7 nothing is
    computed, against 16..23 one anti-causal square (the window's lower edge) and nothing dense."""
    from ndparallel.parallel.cp.attention_blocks import DocLayout, Rect

    docs = DocLayout(None, (3,), 8, 1, torch.device("cpu"), window=4)
    assert docs.groups(0, 0, 8) == []
    assert docs.groups(0, 16, 8) == [(None, (Rect(0, 3, 5, 8, False, True),))]
    rects = docs.groups(0, 24, 8)[0][1]
    assert all(r.k1 - r.k0 <= 4 for r in rects)
