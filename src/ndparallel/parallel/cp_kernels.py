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
* ``math``: fp32 matmuls on any device and dtype; the reference. Scratch O(Lq×Lk) fp32 per block.

``auto`` is ``flash`` where it runs for the inputs, else ``math`` (fp32 on CUDA). ``sdpa`` is the
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


def resolve_kernel(kernel: str, q: torch.Tensor) -> str:
    """``auto``/``flash``/``math`` -> the kernel that runs for ``q`` ('flash' or 'math')."""
    if kernel not in KERNELS:
        raise ValueError(f"kernel={kernel!r} is not one of {', '.join(KERNELS)}")
    flash_ok = q.device.type == "cpu" or cuda_flash_supported(q)
    if kernel == "auto":
        return "flash" if flash_ok else "math"
    if kernel == "flash":
        if not flash_ok:
            raise ValueError(
                f"kernel={kernel!r}: torch's flash attention does not run {q.dtype} head_dim "
                f"{q.shape[-1]} on {q.device}; use kernel='auto' (falls back to 'math')"
            )
        return "flash"
    return kernel


class BlockKernel:
    """One attention call's kernel: ``fwd`` and ``bwd`` of blocks, same scale for all.

    CUDA flash: the backward op wants the random-state tensors of a forward call (unused without
    dropout); the first forward's are kept and passed to every backward call of this attention.
    """

    def __init__(self, name: str, scale: float):
        if name not in ("flash", "math"):
            raise ValueError(f"resolved kernel must be 'flash' or 'math', got {name!r}")
        self.name, self.scale = name, scale
        self._aux = None

    # ------------------------------------------------------------------ forward
    def fwd(self, q, k, v, causal: bool):
        """q [B, H, Lq, D], k/v [B, Hk, Lk, D] -> (out [B, H, Lq, D], lse fp32 [B, H, Lq]).
        ``causal`` needs Lq == Lk (a diagonal square, top-left aligned)."""
        if self.name == "math":
            return _math_fwd(q, k, v, self.scale, causal)
        if q.device.type == "cpu":
            out, lse = _A._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=self.scale)
            return out, lse.float()
        r = _A._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=self.scale)
        if self._aux is None:
            self._aux = (r[2], r[3], r[6], r[7])  # cum_seq_q, cum_seq_k, philox seed, offset
        return r[0], r[1]

    # ----------------------------------------------------------------- backward
    def bwd(self, dout, q, k, v, out, lse, causal: bool):
        """Gradients of one block given the FINAL out/lse of its queries: (dq [B, H, Lq, D],
        dk [B, Hk, Lk, D], dv [B, Hk, Lk, D]), in q's dtype (flash) or fp32 (math)."""
        if self.name == "math":
            return _math_bwd(dout, q, k, v, out, lse, self.scale, causal)
        lse = lse.contiguous()
        if q.device.type == "cpu":
            dq, dk, dv = _A._scaled_dot_product_flash_attention_for_cpu_backward(
                dout, q, k, v, out, lse, 0.0, causal, scale=self.scale)
            return dq, dk, dv
        if self._aux is None:
            raise RuntimeError("flash backward before any flash forward of this attention call")
        cq, ck, seed, offset = self._aux
        dq, dk, dv = _A._scaled_dot_product_flash_attention_backward(
            dout, q, k, v, out, lse, cq, ck, q.shape[2], k.shape[2], 0.0, causal, seed, offset,
            scale=self.scale)
        return dq, dk, dv


# --------------------------------------------------------------------------- math
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


def _math_fwd(q, k, v, scale, causal):
    b, h, lq, _ = q.shape
    s = _scores(q, k, scale, causal)
    lse = torch.logsumexp(s, dim=-1)
    out = torch.matmul(torch.exp(s - lse.unsqueeze(-1)), v.float().unsqueeze(2))
    return out.reshape(b, h, lq, -1), lse.reshape(b, h, lq)


def _math_bwd(dout, q, k, v, out, lse, scale, causal):
    b, h, lq, d = q.shape
    hk = k.shape[1]
    g = h // hk
    delta = (dout.float() * out.float()).sum(-1)
    p = torch.exp(_scores(q, k, scale, causal) - lse.reshape(b, hk, g, lq, 1))
    do = dout.float().reshape(b, hk, g, lq, -1)
    dv = torch.matmul(p.transpose(-1, -2), do).sum(2)
    dp = torch.matmul(do, v.float().unsqueeze(2).transpose(-1, -2))
    ds = p * (dp - delta.reshape(b, hk, g, lq, 1))
    dq = torch.matmul(ds, k.float().unsqueeze(2)).reshape(b, h, lq, d) * scale
    dk = torch.matmul(ds.transpose(-1, -2), q.float().reshape(b, hk, g, lq, d)).sum(2) * scale
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
