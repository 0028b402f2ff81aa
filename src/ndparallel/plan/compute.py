"""Compute model: FLOPs per token (model and hardware) and matmul time on one GPU."""

from __future__ import annotations

from ndparallel.plan.hardware import Hardware
from ndparallel.plan.layout import Layout, Settings
from ndparallel.plan.models import ModelSpec

SMALL_GEMM_DIM = 128
"""A GEMM whose smallest dim is m runs at m/(m+128) of the large-GEMM rate (heuristic)."""


def attention_flops_per_token(model: ModelSpec, seq_len: int) -> float:
    """Training FLOPs of QKᵀ and PV per token with a causal mask: forward 2·(2·a·d·s)/2 per layer,
    backward twice that: 6·L·a·d·s."""
    return 6 * model.layers * model.heads * model.head_dim * seq_len


def model_flops_per_token(model: ModelSpec, seq_len: int, lora_r: int = 0) -> float:
    """6·N (forward 2·N, backward 4·N; N = matmul parameters incl. LM head) + causal attention.
    LoRA of rank ``lora_r``: no weight gradients for the frozen base, 4·N + 2·N_adapter (the
    adapters' forward and input gradients, 4·N_adapter, are neglected: N_adapter ≈ 0.5 % of N)."""
    if lora_r:
        from ndparallel.plan.adapter import trainable_params

        matmul = 4 * model.matmul_params + 2 * trainable_params(model, lora_r)
    else:
        matmul = 6 * model.matmul_params
    return matmul + attention_flops_per_token(model, seq_len)


def hardware_flops_per_token(model: ModelSpec, seq_len: int, checkpointing: bool, lora_r: int = 0) -> float:
    """Model FLOPs plus the recomputed forward (2·N + a third of attention) under checkpointing."""
    flops = model_flops_per_token(model, seq_len, lora_r)
    if checkpointing:
        flops += 2 * model.matmul_params + attention_flops_per_token(model, seq_len) / 3
    return flops


def gemm_efficiency(model: ModelSpec, layout: Layout, s: Settings, hw: Hardware) -> float:
    """Achievable fraction of peak: ``hw.matmul_efficiency`` scaled down when a per-GPU GEMM
    dimension (tokens per rank, q width / tp, MLP width / tp) is small."""
    tokens = s.micro_batch * s.seq_len // layout.cp
    m = min(tokens, model.heads * model.head_dim // layout.tp, model.intermediate // layout.tp)
    return hw.matmul_efficiency * m / (m + SMALL_GEMM_DIM)


def peak(hw: Hardware, s: Settings) -> float:
    return hw.peak_flops if s.mixed_precision == "bf16" else hw.peak_flops_fp32


def compute_time(model: ModelSpec, layout: Layout, s: Settings, hw: Hardware) -> tuple[float, float]:
    """(seconds of one micro-batch's forward+backward on one GPU, of which attention).

    Each GPU does 1/(cp·tp) of the micro-batch's work (load-balanced CP splits causal attention
    evenly)."""
    tokens = s.micro_batch * s.seq_len
    rate = peak(hw, s) * gemm_efficiency(model, layout, s, hw)
    share = tokens / (layout.cp * layout.tp)
    total = share * hardware_flops_per_token(model, s.seq_len, s.checkpointing, s.lora_r) / rate
    attn = attention_flops_per_token(model, s.seq_len) * (4 / 3 if s.checkpointing else 1)
    return total, share * attn / rate
