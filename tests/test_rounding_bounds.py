"""Mechanisms behind layout differences larger than the common fp32 tolerance, reproduced in isolation.

Gemma 4's attention multiplies RMS-normalised queries and keys with ``scaling = 1`` (not
1/sqrt(head_dim)): its logits reach ``head_dim`` in size, so a relative rounding difference
``delta`` in q and k (another summation order: a batch split by FSDP, CP's blockwise attention)
moves each logit by up to ``2 * delta * scaling * |q| |k|`` and each softmax weight by up to twice
that (relative). Bound (docs/families.md): ``|d out| <= 4 * delta * scaling * |q| |k| * max|v|``,
i.e. ``4 * head_dim * delta`` for Gemma 4 and ``4 * sqrt(head_dim) * delta`` for 1/sqrt(d)
attention: sqrt(head_dim) times more.
"""

from __future__ import annotations

import math

import torch


def _rms(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True))


def _attention(q, k, v, scaling: float) -> torch.Tensor:
    return torch.softmax(scaling * q @ k.transpose(-1, -2), dim=-1) @ v


def _amplification(head_dim: int, scaling: float, delta: float, seed: int = 0) -> float:
    """Largest change of the attention output (relative to max|v|) per relative input change
    ``delta`` of q and k, over random RMS-normalised q, k (float64: no rounding of its own)."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(4, 32, head_dim, generator=g, dtype=torch.float64) for _ in range(3))
    q, k = _rms(q), _rms(k)  # |q| = |k| = sqrt(head_dim), as after q_norm / k_norm with unit weights
    eq, ek = ((torch.randint(0, 2, x.shape, generator=g) * 2 - 1).double() * delta for x in (q, k))
    base = _attention(q, k, v, scaling)
    moved = _attention(q * (1 + eq), k * (1 + ek), v, scaling)
    return ((moved - base).abs().max() / v.abs().max()).item() / delta


def test_gemma4_attention_amplifies_rounding_sqrt_head_dim_times_more():
    delta = 2.0**-24  # one fp32 rounding, relative
    for head_dim in (16, 64, 256):
        gemma4 = _amplification(head_dim, 1.0, delta)
        standard = _amplification(head_dim, head_dim**-0.5, delta)
        assert gemma4 <= 4 * head_dim and standard <= 4 * math.sqrt(head_dim), (head_dim, gemma4, standard)
        ratio = gemma4 / standard  # at least the bounds' ratio sqrt(head_dim), up to a factor 2
        assert ratio >= math.sqrt(head_dim) / 2, (head_dim, ratio)
        print(
            f"head_dim {head_dim}: Gemma 4 {gemma4:.1f} (bound {4 * head_dim}), 1/sqrt(d) {standard:.1f} "
            f"(bound {4 * math.sqrt(head_dim):.0f}), ratio {ratio:.1f}"
        )


def test_control_identical_inputs_give_identical_outputs():
    """Negative control: without an input change there is no output change (the measure can be 0)."""
    assert _amplification(16, 1.0, 1e-300) == 0.0
