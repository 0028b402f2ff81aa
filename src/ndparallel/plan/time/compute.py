"""Compute model by op class: time of one micro-batch's forward + backward on one GPU, and the
step's memory-bound extras (optimizer, clipping, FSDP's copies).

* GEMMs by shape (``gemm.py``), the LM head included; checkpointing repeats the layers' forward.
* Attention with the kernel that runs (``attention.py``): causal flash without CP, the ring's
  block kernels with CP.
* Memory-bound ops (``membound.py``): bytes / (``hbm_bw · hbm_efficiency``), broadcast ops at
  ``broadcast_efficiency`` of that.
* Launch overhead: ``KERNELS_PER_LAYER`` kernels per layer each leaving the GPU idle for
  ``kernel_overhead_s``; and the host floor: a micro-batch cannot run faster than its eager ops
  are dispatched (``host_op_s`` each), which is what bounds tiny models.

MFU: model FLOPs per token (``models.flops``: 4·N + 2·N_trained + causal attention 6·L·a·d·s, the
trainer's definition too) over the dtype's peak.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from functools import lru_cache
from operator import attrgetter

from ndparallel.layout.dims import ParallelDims
from ndparallel.models.flops import train_flops_per_token
from ndparallel.plan.adapters.lora_cost import head_copy_trains, trainable_params
from ndparallel.plan.adapters.qlora import dequant_seconds, fsdp_copy_bytes_qlora
from ndparallel.plan.hardware import Hardware
from ndparallel.plan.memory.long_context import mlp_tiles
from ndparallel.plan.models import ModelSpec
from ndparallel.plan.muon_cost import newton_schulz_seconds
from ndparallel.plan.settings import STEP_FIELDS, Settings
from ndparallel.plan.time.attention_time import attention_time
from ndparallel.plan.time.gemm import Gemm, gemm_time, micro_batch_gemms
from ndparallel.plan.time.membound import (
    CLIP_BYTES,
    OPTIMIZER_BYTES,
    Bytes,
    fsdp_copy_bytes,
    layer_bytes_per_token,
    loss_bytes_per_token,
)
from ndparallel.plan.time.recompute_policies import selective_recompute

KERNELS_PER_LAYER = (60, 130)
"""(forward, backward) kernels of one decoder layer: the H200 profile of the Llama-3.2-1B step
(``bench/reference/h200_plan_gpu_check_profile.json``) ran 3,094 kernels for 16 layers, the
loss, FSDP and the optimizer included; ~190 per layer, split about 1 : 2."""


@lru_cache(maxsize=1024)
def model_flops_per_token(
    model: ModelSpec, seq_len: int, lora_r: int = 0, lora_saved: tuple[str, ...] = ()
) -> float:
    """``models.flops.train_flops_per_token`` (the trainer's MFU uses the same definition):
    4·N + 2·N_trained + causal attention 6·L·a·d·s; N_trained = N, or the adapters under LoRA of
    rank ``lora_r`` (no weight gradients for the frozen base) plus a trained LM head copy
    (``lora_saved``; the embedding's is a lookup, no matmul). Cached: asked once per option."""
    trained = model.matmul_params
    if lora_r:
        trained = trainable_params(model, lora_r)
        if head_copy_trains(model, lora_saved):
            trained += model.vocab * model.hidden
    return train_flops_per_token(
        model.matmul_params, trained, model.layers, model.heads * model.head_dim, seq_len
    )


def peak(hw: Hardware, s: Settings) -> float:
    return (
        hw.peak_flops if s.mixed_precision in ("bf16", "fp16") else hw.peak_flops_fp32
    )  # same tensor-core peak


@dataclass(frozen=True)
class ComputeBreakdown:
    """Seconds of one micro-batch (forward + backward + recompute) on one GPU, by op class."""

    gemm: float
    attention: float
    elementwise: float
    loss: float
    launch: float
    host_floor: float
    """Host dispatch time of the micro-batch's eager ops; the total is at least this."""

    @property
    def total(self) -> float:
        gpu = self.gemm + self.attention + self.elementwise + self.loss + self.launch
        return max(gpu, self.host_floor)

    def to_dict(self) -> dict:
        return {
            "gemm": self.gemm,
            "attention": self.attention,
            "elementwise": self.elementwise,
            "loss": self.loss,
            "launch": self.launch,
            "host_floor": self.host_floor,
            "total": self.total,
        }


def bytes_time(b: Bytes, hw: Hardware) -> float:
    bw = hw.hbm_bw * hw.hbm_efficiency
    return b.stream / bw + b.broadcast / (bw * hw.broadcast_efficiency)


def all_gemms(model: ModelSpec, layout: ParallelDims, s: Settings) -> list[Gemm]:
    """``micro_batch_gemms``: the chunked loss does the LM head's three matmuls too (forward,
    input and weight gradient, computed chunk by chunk in its forward), so nothing is added."""
    return micro_batch_gemms(model, layout, s)


def micro_batch_time(model: ModelSpec, layout: ParallelDims, s: Settings, hw: Hardware) -> ComputeBreakdown:
    """Time of one micro-batch on one GPU (each GPU does 1/(c·t) of the work). Cached on what it
    depends on (the search asks for the same micro-batch under many layouts and step settings):
    a dense model's tp and cp, the settings less the step-level ones (``STEP_DEFAULTS``), keyed by their
    values (``micro_batch_key``: no ``Settings`` built or hashed per call)."""
    dims = layout if model.is_moe else (layout.cp, layout.tp)
    return _micro_batch_time(model, dims, micro_batch_key(s), hw, id(hw))


STEP_DEFAULTS = {f.name: f.default for f in fields(Settings) if f.name in STEP_FIELDS}
"""The settings of the optimizer step and of accumulation (``plan/settings.py``'s ``STEP_FIELDS``),
which one micro-batch (its compute, and in ``plan/memory/peak.py`` its activations, logits and
workspace) ignores, at their defaults: a neutral step."""
MICRO_BATCH_FIELDS = tuple(f.name for f in fields(Settings) if f.name not in STEP_FIELDS)
micro_batch_key = attrgetter(*MICRO_BATCH_FIELDS)
"""The values of every other ``Settings`` field, one tuple: the key of what one micro-batch costs."""


@lru_cache(maxsize=4096)
def _micro_batch_time(
    model: ModelSpec, dims: ParallelDims | tuple[int, int], values: tuple, hw: Hardware, _hw: int
) -> ComputeBreakdown:
    """``micro_batch_time`` of ``dims`` (a dense model's (cp, tp)) and the settings whose other
    fields are ``values`` (their step-level ones ``STEP_DEFAULTS``); ``_hw`` = id(hw): calibrated
    profiles equal in their compared fields differ."""
    layout = dims if isinstance(dims, ParallelDims) else ParallelDims(cp=dims[0], tp=dims[1])
    s = Settings(**dict(zip(MICRO_BATCH_FIELDS, values)), **STEP_DEFAULTS)
    pk = peak(hw, s)
    tokens = s.micro_batch_size * s.sequence_len / layout.cp
    gemm = gemm_time(hw, all_gemms(model, layout, s), pk)
    fwd_a, bwd_a = attention_time(model, layout, s, hw, pk)
    fwd_b, bwd_b = layer_bytes_per_token(model, layout, s)
    again, again_kernels = _recomputed(model, layout, s, fwd_b)
    layer = fwd_b + again + bwd_b
    if s.tiled_mlp:  # the SwiGLU of the tile recomputed in backward (5e per element of f/t)
        layer += Bytes(5 * s.act_bytes * model.intermediate / layout.tp)
    # The selective policy keeps the attention output: attention is not recomputed.
    attn = fwd_a * (2 if s.recompute == "full" else 1) + bwd_a
    elementwise = bytes_time(layer * (tokens * model.layers), hw)
    loss = bytes_time(loss_bytes_per_token(model, layout, s) * tokens, hw) if model.has_lm_head else 0.0
    kf, kb = KERNELS_PER_LAYER
    kernels = model.layers * (kf + again_kernels + kb)
    if s.tiled_mlp:  # per tile ~6 forward kernels (3 GEMMs, SiLU, product, copy), 2 forwards + ~12 back
        kernels += model.layers * mlp_tiles(model, layout, s)[0] * (6 * (2 + s.activation_checkpointing) + 12)
    return ComputeBreakdown(
        gemm, attn, elementwise, loss, kernels * hw.kernel_overhead_s, kernels * hw.host_op_s
    )


def _recomputed(model: ModelSpec, layout: ParallelDims, s: Settings, fwd: Bytes) -> tuple[Bytes, int]:
    """(element-wise bytes per token, kernels) of one layer's forward run again in backward."""
    if s.recompute in ("full", "op"):
        return fwd, KERNELS_PER_LAYER[0]
    if s.recompute == "selective":
        return selective_recompute(model, layout, s)
    return Bytes(), 0


def step_extras(
    model: ModelSpec,
    layout: ParallelDims,
    s: Settings,
    hw: Hardware,
    local_params: float,
    shard_params: float,
    trained_params: float | None = None,
) -> dict[str, float]:
    """Per-step memory-bound seconds outside the micro-batches: optimizer, clipping, FSDP copies.
    ``trained_params``: the shard the optimizer updates (LoRA: the adapters'; default: all)."""
    bw = hw.hbm_bw * hw.hbm_efficiency
    trained = shard_params if trained_params is None else trained_params
    opt = trained * OPTIMIZER_BYTES[(s.optimizer, s.optimizer_fused)] / bw
    clip = trained * CLIP_BYTES / bw
    fsdp = fsdp_copy_bytes(model, layout, s, local_params, shard_params) / bw
    if s.optimizer == "muon":  # its Newton-Schulz GEMMs (plan/muon_cost.py)
        opt += newton_schulz_seconds(model, layout, hw)
    out = {"optimizer": opt, "clip": clip, "fsdp_copies": fsdp}
    if s.load_in_4bit:  # QLoRA: every NF4 weight dequantised in forward and backward (plan/adapters/qlora.py)
        out["nf4_dequant"] = dequant_seconds(model, layout, s, bw)
        out["fsdp_copies"] = fsdp_copy_bytes_qlora(model, layout, s, local_params, shard_params) / bw
    return out


def compute_time(model: ModelSpec, layout: ParallelDims, s: Settings, hw: Hardware) -> tuple[float, float]:
    """(seconds of one micro-batch, of which attention) — the pair the step model overlaps."""
    c = micro_batch_time(model, layout, s, hw)
    return c.total, c.attention
