"""Block kernels of the context-parallel attention.

A *block* is the queries of one span attending to the keys of one span, either densely or
causally (a square on the diagonal). A kernel returns the block's output and the log-sum-exp (LSE)
of its scores, so blocks of the same queries can be merged exactly (``merge_``); its backward
takes the *final* output and LSE of those queries (flash-attention style), so nothing of size
Lq×Lk is kept between forward and backward.

Kernels (``resolve_kernel``):

* ``flash``: torch's fused flash-attention op and its backward —
  ``aten._scaled_dot_product_flash_attention`` on CUDA (bf16/fp16, head_dim a multiple of 8 and
  <= 256, sm80+), ``aten._scaled_dot_product_flash_attention_for_cpu`` on CPU (any float dtype).
  GQA native: K/V are never repeated, dK/dV come back with the K/V head count. Scratch O(block).
* ``math``: fp32 matmuls on any device and dtype; the reference, and the only kernel for
  soft-capped scores (Gemma 2). Queries are processed in row tiles of at most 2^24 scores
  (64 MiB fp32 per tile, ~3× that with the softmax and backward temporaries), whatever the block.

``auto`` is ``flash`` where it runs for the inputs (no soft cap), else ``math`` (fp32 on CUDA).
Anti-causal squares (a sliding window's lower edge) run as causal squares on the reversed
sequences: one extra copy of the block's Q, K, V (and dO, O in backward). ``sdpa`` is the
old name of ``flash``. The mem-efficient CUDA kernel is not used: its backward gave NaN dQ/dK in
bf16 on an H200 (docs/context_parallel.md).
"""

from __future__ import annotations

import torch

KERNELS = ("auto", "flash", "math")
_A = torch.ops.aten


def cuda_flash_supported(q: torch.Tensor) -> bool:
    """Can torch's CUDA flash-attention op run these queries (dtype, head dim, GPU)?"""
    if q.device.type != "cuda" or q.dtype not in (torch.float16, torch.bfloat16):
        return False
    d = q.shape[-1]
    if d % 8 or d > 256 or not torch.backends.cuda.flash_sdp_enabled():
        return False
    return torch.cuda.get_device_capability(q.device) >= (8, 0)


def resolve_kernel(kernel: str, q: torch.Tensor, softcap: float | None = None) -> str:
    """``auto``/``flash``/``math`` -> the kernel that runs for ``q`` ('flash' or 'math');
    soft-capped scores run on 'math' (flash has no soft cap)."""
    if kernel not in KERNELS:
        raise ValueError(f"kernel={kernel!r} is not one of {', '.join(KERNELS)}")
    flash_ok = (q.device.type == "cpu" or cuda_flash_supported(q)) and not softcap
    if kernel == "auto":
        return "flash" if flash_ok else "math"
    if kernel == "flash":
        if not flash_ok:
            raise ValueError(
                f"kernel={kernel!r}: torch's flash attention does not run {q.dtype} head_dim "
                f"{q.shape[-1]} on {q.device}{' with soft-capped scores' if softcap else ''}; use "
                "kernel='auto' (falls back to 'math')"
            )
        return "flash"
    return kernel


class BlockKernel:
    """One attention call's kernel: ``fwd`` and ``bwd`` of blocks, same scale for all.

    ``softcap`` (Gemma 2): scores become ``softcap · tanh(score / softcap)`` before the softmax;
    only the math kernel computes that (``resolve_kernel`` picks it). An *anti-causal* square
    (key j visible iff j >= i: a sliding window's lower edge) runs as a causal square on the
    sequence-reversed inputs, with either kernel.

    CUDA flash: the backward op wants the random-state tensors of a forward call (unused without
    dropout); the first forward's are kept and passed to every backward call of this attention.
    """

    def __init__(self, name: str, scale: float, softcap: float | None = None):
        if name not in ("flash", "math"):
            raise ValueError(f"resolved kernel must be 'flash' or 'math', got {name!r}")
        if softcap and name != "math":
            raise ValueError("soft-capped attention scores need the 'math' kernel")
        self.name, self.scale, self.softcap = name, scale, softcap or None
        self._aux = None

    # ------------------------------------------------------------------ forward
    def fwd(self, q, k, v, causal: bool, anti: bool = False):
        """q [B, H, Lq, D], k/v [B, Hk, Lk, D] -> (out [B, H, Lq, D], lse fp32 [B, H, Lq]).
        ``causal`` / ``anti`` need Lq == Lk (a square on the diagonal, top-left aligned)."""
        if anti:
            out, lse = self.fwd(q.flip(2), k.flip(2), v.flip(2), True)
            return out.flip(2), lse.flip(2)
        if self.name == "math":
            return _math_fwd(q, k, v, self.scale, causal, self.softcap)
        if q.device.type == "cpu":
            out, lse = _A._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=self.scale)
            return out, lse.float()
        r = _A._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=self.scale)
        if self._aux is None:
            self._aux = (r[2], r[3], r[6], r[7])  # cum_seq_q, cum_seq_k, philox seed, offset
        return r[0], r[1]

    # ----------------------------------------------------------------- backward
    def bwd(self, dout, q, k, v, out, lse, causal: bool, anti: bool = False):
        """Gradients of one block given the FINAL out/lse of its queries: (dq [B, H, Lq, D],
        dk [B, Hk, Lk, D], dv [B, Hk, Lk, D]), in q's dtype (flash) or fp32 (math)."""
        if anti:
            grads = self.bwd(dout.flip(2), q.flip(2), k.flip(2), v.flip(2), out.flip(2), lse.flip(2), True)
            return tuple(g.flip(2) for g in grads)
        if self.name == "math":
            return _math_bwd(dout, q, k, v, out, lse, self.scale, causal, self.softcap)
        lse = lse.contiguous()
        if q.device.type == "cpu":
            dq, dk, dv = _A._scaled_dot_product_flash_attention_for_cpu_backward(
                dout, q, k, v, out, lse, 0.0, causal, scale=self.scale
            )
            return dq, dk, dv
        if self._aux is None:
            raise RuntimeError("flash backward before any flash forward of this attention call")
        cq, ck, seed, offset = self._aux
        dq, dk, dv = _A._scaled_dot_product_flash_attention_backward(
            dout,
            q,
            k,
            v,
            out,
            lse,
            cq,
            ck,
            q.shape[2],
            k.shape[2],
            0.0,
            causal,
            seed,
            offset,
            scale=self.scale,
        )
        return dq, dk, dv


# --------------------------------------------------------------------------- math
_MATH_SCORES = 2**24
"""Scores held at once by the math kernel (fp32: 64 MiB): queries are processed in row tiles."""


def _row_tiles(q, lk: int):
    b, h, lq, _ = q.shape
    step = max(1, _MATH_SCORES // max(1, b * h * lk))
    return [(r, min(r + step, lq)) for r in range(0, lq, step)]


def _scores(q, k, scale, causal, softcap, r0: int = 0):
    """fp32 scores [B, Hk, G, Lq, Lk] of queries starting at row ``r0`` of the block (for the
    causal mask) and the tanh of the soft cap (None without one); GQA by broadcasting."""
    b, h, lq, d = q.shape
    hk = k.shape[1]
    s = torch.matmul(q.float().view(b, hk, h // hk, lq, d), k.float().unsqueeze(2).transpose(-1, -2))
    s = s * scale
    t = None
    if softcap:
        t = torch.tanh(s / softcap)
        s = t * softcap
    if causal:
        mask = torch.ones(lq, k.shape[2], dtype=torch.bool, device=q.device).triu_(1 + r0)
        s = s.masked_fill(mask, float("-inf"))
    return s, t


def _math_fwd(q, k, v, scale, causal, softcap=None):
    b, h, lq, _ = q.shape
    out = torch.empty(b, h, lq, v.shape[-1], dtype=torch.float32, device=q.device)
    lse = torch.empty(b, h, lq, dtype=torch.float32, device=q.device)
    vf = v.float().unsqueeze(2)
    for r0, r1 in _row_tiles(q, k.shape[2]):
        s, _ = _scores(q[:, :, r0:r1], k, scale, causal, softcap, r0)
        tile_lse = torch.logsumexp(s, dim=-1)
        o = torch.matmul(torch.exp(s - tile_lse.unsqueeze(-1)), vf)
        out[:, :, r0:r1] = o.reshape(b, h, r1 - r0, -1)
        lse[:, :, r0:r1] = tile_lse.reshape(b, h, r1 - r0)
    return out, lse


def _math_bwd(dout, q, k, v, out, lse, scale, causal, softcap=None):
    b, h, lq, d = q.shape
    hk = k.shape[1]
    g = h // hk
    dq = torch.empty(b, h, lq, d, dtype=torch.float32, device=q.device)
    dk = torch.zeros(k.shape, dtype=torch.float32, device=q.device)
    dv = torch.zeros(v.shape, dtype=torch.float32, device=q.device)
    vf, kf = v.float().unsqueeze(2), k.float().unsqueeze(2)
    for r0, r1 in _row_tiles(q, k.shape[2]):
        n = r1 - r0
        qt, dot = q[:, :, r0:r1], dout[:, :, r0:r1].float()
        delta = (dot * out[:, :, r0:r1].float()).sum(-1)
        s, t = _scores(qt, k, scale, causal, softcap, r0)
        p = torch.exp(s - lse[:, :, r0:r1].reshape(b, hk, g, n, 1))
        do = dot.reshape(b, hk, g, n, -1)
        dv += torch.matmul(p.transpose(-1, -2), do).sum(2)
        ds = p * (torch.matmul(do, vf.transpose(-1, -2)) - delta.reshape(b, hk, g, n, 1))
        if t is not None:  # d(c·tanh(x/c))/dx = 1 − tanh²
            ds = ds * (1 - t * t)
        dq[:, :, r0:r1] = torch.matmul(ds, kf).reshape(b, h, n, d) * scale
        dk += torch.matmul(ds.transpose(-1, -2), qt.float().reshape(b, hk, g, n, d)).sum(2) * scale
    return dq, dk, dv


# -------------------------------------------------------------------------- merge
def merge_(acc_out: torch.Tensor, acc_lse: torch.Tensor, out: torch.Tensor, lse: torch.Tensor) -> None:
    """acc <- acc ⊕ (out, lse), in place, in fp32: ``acc_lse`` starts at -inf and ``acc_out`` at 0
    (views into the running result are fine). ``lse`` must be finite (every query of a block sees
    at least one key), so no -inf - -inf arises."""
    new = torch.logaddexp(acc_lse, lse)
    acc_out.mul_(torch.exp(acc_lse - new).unsqueeze(-1))
    acc_out.addcmul_(out, torch.exp(lse - new).unsqueeze(-1))
    acc_lse.copy_(new)
