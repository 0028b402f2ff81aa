"""Training metrics: throughput, FLOPs, MFU, peak memory (written by ``ndparallel.tracking.run``)."""

from __future__ import annotations

import torch

from ndparallel.models.flops import attention_dim, matmul_params, train_flops_per_token
from ndparallel.plan.hardware import PRESETS
from ndparallel.runtime.memory_probe import peak_rss_bytes


def model_flops_per_token(model: torch.nn.Module, config, seq_len: int) -> float:
    """Training FLOPs per token of ``model`` at ``seq_len`` (``models.flops``: the definition the
    planner uses too)."""

    n, trained = matmul_params(model)  # a multimodal model: its towers' linears too (an overcount)
    config = config.get_text_config()
    return train_flops_per_token(n, trained, config.num_hidden_layers, attention_dim(config), seq_len)


def device_peak_flops(device: torch.device, bf16: bool) -> float | None:
    """Dense peak FLOP/s of a known GPU (from the planner's hardware presets); None if unknown."""
    if device.type != "cuda":
        return None

    name = torch.cuda.get_device_name(device).lower()
    mem_gb = torch.cuda.get_device_properties(device).total_memory / 2**30
    for key in ("h200", "h100", "a100"):
        if key in name:
            candidates = [h for n, h in PRESETS.items() if n.startswith(key)]
            best = min(candidates, key=lambda h: abs(h.mem_bytes / 2**30 - mem_gb))
            return best.peak_flops if bf16 else best.peak_flops_fp32
    return None


def peak_memory_gb(device: torch.device) -> float:
    """Peak accelerator memory allocated, or this process's peak RSS on CPU, in GiB."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30

    return peak_rss_bytes() / 2**30


def global_numel(model: torch.nn.Module, trainable_only: bool = False) -> int:
    """Parameters of the whole (unsharded) model, tied ones once (only trainable ones if asked)."""
    from torch.distributed.tensor import DTensor

    unique = {id(p): p for p in model.parameters() if p.requires_grad or not trainable_only}.values()
    return sum(p.shape.numel() if isinstance(p, DTensor) else p.numel() for p in unique)


def local_numel(model: torch.nn.Module) -> int:
    """Parameter elements this rank holds (its shards), tied ones once."""
    from torch.distributed.tensor import DTensor

    unique = {id(p): p for p in model.parameters()}.values()
    return sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in unique)
