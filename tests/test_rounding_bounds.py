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


# ------------------------------------------------------------------ the rule's regression guard
def _gemma4_text():
    from transformers import Gemma4TextConfig

    return Gemma4TextConfig(
        vocab_size=256,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        global_head_dim=16,
        intermediate_size=128,
        layer_types=["full_attention", "full_attention"],
        hidden_size_per_layer_input=16,
        vocab_size_per_layer_input=256,
    )


def test_right_layout_with_large_rounding_passes():
    """Gemma 4 (unit-scaled QK-norm attention) under CP 2: its rounding is the largest of the suite's
    cells (issue 47: 3.7e-5 relative grad norm on an Intel AVX-512 path); the bound carries its
    sqrt(head_dim) and the correct layout passes with headroom."""
    from ndparallel.testing import run_on_ranks
    from ndparallel.tools.agreement import assert_matches, one_process_reference
    from ndparallel.tools.equivalence import TrainSetup, train_under_layout

    setup = TrainSetup(
        _gemma4_text(),
        steps=3,
        global_micro_batch=2,
        seq_len=32,
        optimizer="sgd",
        lr=0.1,
        packed_documents=True,
    )
    ref = one_process_reference(setup)
    assert all("sqrt(head_dim 16)" in source for source in ref.bounds.sources.values()), ref.bounds
    got = run_on_ranks(train_under_layout, 2, setup, {"cp_size": 2})[0]
    assert_matches(ref, got)


def test_fault_just_above_the_noise_floor_fails():
    """The last rank's gradient shards 1e-3 too large (a reduction weighting one rank's part wrong
    by a hair) under FSDP 2 fails, within 100× of its bound: the bounds are that tight; 1e-5
    (below what fp32 training can tell apart over 3 steps) passes."""
    import dataclasses

    from ndparallel.models.presets import preset_config
    from ndparallel.testing import run_on_ranks
    from ndparallel.tools.agreement import one_process_reference, verdict
    from ndparallel.tools.equivalence import TrainSetup, train_under_layout

    setup = TrainSetup(
        preset_config("tiny-llama"), steps=3, global_micro_batch=4, seq_len=32, optimizer="sgd", lr=0.5
    )
    ref = one_process_reference(setup)
    results = {}
    for eps in (1e-3, 1e-5):
        broken = dataclasses.replace(setup, fault=f"scaled-last-shard:{eps}")
        got = run_on_ranks(train_under_layout, 2, broken, {"dp_shard_size": 2})[0]
        results[eps] = verdict(ref, got, expect_equal=eps < 1e-4)
    hair = results[1e-3]
    assert not hair.ok and hair.ratios[hair.worst] < 100, hair.line()
    assert results[1e-5].ok, results[1e-5].line()
