"""Block kernels (flash, math) and the document geometry of the CP attention, on one process."""

import pytest
import torch

from ndparallel.parallel.cp.attention_blocks import DocLayout, Rect, document_starts
from ndparallel.parallel.cp.attention_kernels import BlockKernel, merge_, resolve_kernel


def _qkv(dtype, lq=12, lk=12, heads=4, kv_heads=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    # HF layout: [B, S, H, D] transposed to [B, H, S, D] (not contiguous), as the model passes them
    q = torch.randn(2, lq, heads, 8, generator=g).transpose(1, 2).to(dtype)
    k, v = (torch.randn(2, lk, kv_heads, 8, generator=g).transpose(1, 2).to(dtype) for _ in range(2))
    return q, k, v


def _sdpa_with_lse(q, k, v, scale, causal):
    """fp64 reference: output and log-sum-exp of one block."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(groups, 1), v.double().repeat_interleave(groups, 1)
    s = q.double() @ k.transpose(-1, -2) * scale
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
    lse = torch.logsumexp(s, -1)
    return torch.softmax(s, -1) @ v, lse


@pytest.mark.parametrize("name", ["math", "flash"])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_block_forward_and_lse(name, dtype, tol):
    for causal, lk in ((True, 12), (False, 7)):
        q, k, v = _qkv(dtype, lk=12 if causal else lk)
        out, lse = BlockKernel(name, 0.3).fwd(q, k, v, causal)
        ref, ref_lse = _sdpa_with_lse(q, k, v, 0.3, causal)
        assert out.shape == q.shape and lse.shape == q.shape[:3] and lse.dtype == torch.float32
        assert (out.double() - ref).abs().max() / ref.abs().max() <= tol
        assert (lse.double() - ref_lse).abs().max() <= tol * 10


@pytest.mark.parametrize("name", ["math", "flash"])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_two_blocks_merged_equal_one_causal_attention(name, dtype, tol):
    """Keys split into a dense block (the first 5) and a causal square (the last 7): the merged
    forward and the per-block backward given the FINAL out/lse equal full attention (GQA)."""
    q, k, v = _qkv(dtype, lq=7, lk=12)
    kernel = BlockKernel(name, 0.3)
    acc_out = torch.zeros(q.shape)
    acc_lse = torch.full(q.shape[:3], float("-inf"))
    for ks, causal in ((slice(0, 5), False), (slice(5, 12), True)):
        merge_(acc_out, acc_lse, *kernel.fwd(q, k[:, :, ks], v[:, :, ks], causal))
    out = acc_out.to(dtype)
    dout = torch.randn(q.shape).to(dtype)
    dq, dk, dv = torch.zeros(q.shape), torch.zeros(k.shape), torch.zeros(v.shape)
    for ks, causal in ((slice(0, 5), False), (slice(5, 12), True)):
        g_q, g_k, g_v = kernel.bwd(dout, q, k[:, :, ks], v[:, :, ks], out, acc_lse, causal)
        assert g_k.shape == k[:, :, ks].shape  # GQA: K/V never repeated
        dq += g_q
        dk[:, :, ks] += g_k
        dv[:, :, ks] += g_v
    rq, rk, rv = (t.detach().double().requires_grad_() for t in (q, k, v))
    mask = torch.ones(7, 12, dtype=torch.bool).tril(5)  # query i sees keys <= 5 + i
    ref = torch.nn.functional.scaled_dot_product_attention(
        rq, rk.repeat_interleave(2, 1), rv.repeat_interleave(2, 1), attn_mask=mask, scale=0.3
    )
    ref.backward(dout.double())
    for got, want in ((acc_out, ref), (dq, rq.grad), (dk, rk.grad), (dv, rv.grad)):
        assert (got.double() - want).abs().max() / want.abs().max() <= tol


def test_resolve_kernel():
    cpu = torch.zeros(1, 1, 4, 8)
    assert resolve_kernel("auto", cpu) == "flash"
    with pytest.raises(ValueError, match="not one of"):  # transformers' name, not a CP kernel
        resolve_kernel("sdpa", cpu)
    assert resolve_kernel("math", cpu) == "math"
    with pytest.raises(ValueError, match="kernel='cudnn'"):
        resolve_kernel("cudnn", cpu)


def test_document_geometry():
    """Two local chunks of 8 tokens (global chunks 1 and 2 of cp=2): documents start at global
    6, 11 and 20 (outside these chunks) in row 0; row 1 is one document."""
    pos = torch.tensor([list(range(6)) + list(range(5)) + list(range(9)) + list(range(12)), list(range(32))])
    index = torch.arange(8, 24)
    starts = document_starts(pos[:, 8:24], index, 2)
    assert starts[0].tolist() == [6] * 3 + [11] * 9 + [20] * 4
    docs = DocLayout(starts, (1, 2), 8, 2, torch.device("cpu"))
    # chunk 1 (tokens 8..15) against its own chunk: run [8,11) of the document from 6, run [11,16)
    row0, row1 = ((g[1], g[0]) for g in docs.groups(0, 8, 8))
    assert row0[0] == (Rect(0, 3, 0, 3, True), Rect(3, 8, 3, 8, True))
    assert row1[0] == (Rect(0, 8, 0, 8, True),)
    assert row0[1].tolist() == [0] and row1[1].tolist() == [1]
    # chunk 1 against chunk 0 (tokens 0..7): only row 0's first run sees keys 6, 7; row 1 all
    dense = {g[1]: g[0].tolist() for g in docs.groups(0, 0, 8)}
    assert dense == {(Rect(0, 3, 6, 8, False),): [0], (Rect(0, 8, 0, 8, False),): [1]}
    # chunk 2 (tokens 16..23) against chunk 0: row 0's documents all start after token 7: skipped
    assert [(g[0].tolist(), g[1]) for g in docs.groups(1, 0, 8)] == [([1], (Rect(0, 8, 0, 8, False),))]
    # chunk 1 against chunk 2: in the future, nothing
    assert docs.groups(0, 16, 8) == []
    plain = DocLayout(None, (1, 2), 8, 2, torch.device("cpu"))
    assert plain.groups(1, 0, 16) == [(None, (Rect(0, 8, 0, 16, False),))]
