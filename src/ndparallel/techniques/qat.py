"""Quantisation-aware training with torchao's fake quantisation (Axolotl's ``qat:``).

Applied first, before TP and FSDP: ``torchao.quantization.quantize_`` with a ``QATConfig`` swaps
every ``nn.Linear`` (the LM head included, as Axolotl does; LoRA's own A / B matrices excluded) for a
fake-quantised linear, and with ``quantize_embedding`` the input embedding too. In the forward the
weight (and the input activations) are rounded to the target format and back; the backward is the
straight-through estimate; the parameters, gradients and optimizer states stay full precision.
FSDP2 shards the swapped modules like any linear: the fake quantiser sees the gathered (whole)
weight, so sharding does not change the numerics. The formats, as Axolotl builds them:

==================  ==============  =========================================================
weight_dtype        activation      torchao fake quantisers
==================  ==============  =========================================================
int4                none            ``Int4WeightFakeQuantizeConfig(group_size)`` (weights only)
int4                int8            + ``IntxFakeQuantizeConfig(int8, per_token, asymmetric)``
int4                float8          + ``Float8FakeQuantizeConfig(e4m3)`` activations
float8              float8          ``Float8FakeQuantizeConfig(e4m3)`` for both
mxfp4               mxfp4           ``MXFakeQuantizeConfig(fp4 e2m1, block 32)`` for both
nvfp4               nvfp4           ``NVFP4FakeQuantizeConfig`` for both (block 16; the fp4 matmul
                                    itself: NVIDIA Blackwell, compute capability >= 10.0)
==================  ==============  =========================================================

The trained model is saved unquantised (the fake quantisers hold no state: the state dict has the
plain linears' names); quantise it afterwards with the same settings (torchao's ``quantize_`` or
``axolotl quantize``), as after Axolotl's QAT.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from ndparallel.runtime.extras import require
from ndparallel.techniques.technique_options import QATOptions

_COMBINATIONS = {
    ("int4", None),
    ("int4", "int8"),
    ("int4", "float8"),
    ("float8", "float8"),
    ("mxfp4", "mxfp4"),
    ("nvfp4", "nvfp4"),
}
NVFP4_CAPABILITY = (10, 0)


def qat_options_problem(o: QATOptions) -> str | None:
    """Why torchao cannot fake-quantise these settings (None: it can), with the fix."""
    if not o.enabled:
        return None
    w, a = o.weight_dtype, o.activation_dtype
    if (w, a) not in _COMBINATIONS:
        valid = ", ".join(f"{x}/{y or 'none'}" for x, y in sorted(_COMBINATIONS, key=str))
        why = {"int8": "int8 weights have no torchao QAT config"}.get(w, "not a torchao QAT combination")
        return (
            f"weight_dtype {w} with activation_dtype {a or 'none'}: {why}; use one of (weight/activation) "
            f"{valid}"
        )
    block = {"nvfp4": 16, "mxfp4": 32}.get(w)
    if block is not None and o.group_size not in (None, block):
        return f"{w} quantises blocks of {block} values: set group_size: {block} (or leave it out)"
    if w == "int4" and (o.group_size is None or o.group_size < 1):
        return "int4 weights are quantised in groups: set group_size (e.g. 32, 64, 128, 256)"
    if o.quantize_embedding and w != "int4":
        return (
            f"quantize_embedding fake-quantises the embedding's weight alone, which torchao does for int4 "
            f"weights only (not {w}): remove quantize_embedding or use weight_dtype: int4"
        )
    if o.fake_quant_after_n_steps is not None and w in ("mxfp4", "nvfp4"):
        return (
            f"fake_quant_after_n_steps switches the fake quantisers off and on, which torchao's {w} linears "
            "cannot do: remove fake_quant_after_n_steps (or use weight_dtype int4 / float8)"
        )
    return None


def qat_device_problem(o: QATOptions, device_type: str) -> str | None:
    """Why these settings cannot train on ``device_type`` (None: they can): nvfp4 fake quantisation
    runs the fp4 matmul (``torch._scaled_mm``), which needs a Blackwell GPU."""
    if not o.enabled or o.weight_dtype != "nvfp4":
        return None
    if device_type == "cuda" and torch.cuda.is_available():
        cap = torch.cuda.get_device_capability()
        if cap >= NVFP4_CAPABILITY:
            return None
        where = f"{torch.cuda.get_device_name()} has {cap[0]}.{cap[1]}"
    else:
        where = "this run has no CUDA GPU"
    return (
        f"nvfp4 fake quantisation runs torchao's fp4 matmul, which needs an NVIDIA GPU of compute capability "
        f">= 10.0 (B200, GB200); {where}: use weight_dtype/activation_dtype mxfp4 (fp4 e2m1 values, blocks "
        f"of 32; runs anywhere) or int4 weights"
    )


def group_size_problem(model: nn.Module, o: QATOptions) -> str | None:
    """The first linear (or embedding) whose input width is not a multiple of the quantisation
    group / block (None: every one is)."""
    if not o.enabled:
        return None
    group = o.group_size or {"nvfp4": 16, "mxfp4": 32}.get(o.weight_dtype)
    if not group:
        return None
    for name, module in model.named_modules():
        width = (
            module.in_features
            if isinstance(module, nn.Linear) and _swapped(name)
            else module.embedding_dim
            if isinstance(module, nn.Embedding) and o.quantize_embedding
            else None
        )
        if width is not None and width % group:
            return (
                f"{name} has {width} input features, not a multiple of the qat group_size {group}: set "
                f"qat.group_size to a divisor of {width} (every linear's input width must be a multiple)"
            )
    return None


def _swapped(name: str) -> bool:
    """LoRA's low-rank A / B stay full precision: only the layers they adapt are fake-quantised."""
    return ".lora_" not in f".{name}"


def _fake_quantize_configs(o: QATOptions, with_activation: bool = True):
    """torchao's (weight, activation) fake-quantise configs for ``o`` (Axolotl's choices)."""
    from torchao.quantization.qat import Float8FakeQuantizeConfig, IntxFakeQuantizeConfig
    from torchao.quantization.qat.fake_quantize_config import Int4WeightFakeQuantizeConfig

    w, a = o.weight_dtype, o.activation_dtype if with_activation else None
    if w == "mxfp4":
        from torchao.prototype.qat import MXFakeQuantizeConfig

        mx = MXFakeQuantizeConfig(dtype=torch.float4_e2m1fn_x2, block_size=32)
        return mx, mx
    if w == "nvfp4":
        from torchao.prototype.qat import NVFP4FakeQuantizeConfig

        return NVFP4FakeQuantizeConfig(), NVFP4FakeQuantizeConfig()
    act = {
        "int8": lambda: IntxFakeQuantizeConfig(torch.int8, "per_token", is_symmetric=False),
        "float8": lambda: Float8FakeQuantizeConfig(dtype=torch.float8_e4m3fn),
    }.get(a, lambda: None)()
    if w == "float8":
        return Float8FakeQuantizeConfig(dtype=torch.float8_e4m3fn), act
    # int4: the kernel it targets takes float8 or bf16 activations (int8 ones are fake-quantised apart)
    act_dtype = torch.float8_e4m3fn if a == "float8" else torch.bfloat16
    return Int4WeightFakeQuantizeConfig(group_size=o.group_size, activation_dtype=act_dtype), act


def apply_qat(model: nn.Module, options: QATOptions) -> nn.Module:
    """Swap ``model``'s linears (and with ``quantize_embedding`` its embeddings) for torchao's
    fake-quantised modules, in place (meta-device models too); return the model."""
    problem = qat_options_problem(options) or group_size_problem(model, options)
    if problem:
        raise ValueError(f"qat: {problem}")
    require("qat", "qat (fake-quantised training)")
    from torchao.quantization import quantize_
    from torchao.quantization.qat import QATConfig

    weight, act = _fake_quantize_configs(options)
    quantize_(
        model,
        QATConfig(weight_config=weight, activation_config=act, step="prepare"),
        filter_fn=lambda m, name: isinstance(m, nn.Linear) and _swapped(name),
    )
    if options.quantize_embedding:  # activation fake quantisation does not apply to a lookup
        weight, _ = _fake_quantize_configs(options, with_activation=False)
        quantize_(
            model,
            QATConfig(weight_config=weight, step="prepare"),
            filter_fn=lambda m, _: isinstance(m, nn.Embedding),
        )
    recompute_quantizers(model)
    if options.fake_quant_after_n_steps is not None:
        set_fake_quant(model, options.fake_quant_after_n_steps == 0)
    return model


class RecomputedQuantizer(nn.Module):
    """A torchao fake quantiser run under a non-reentrant activation checkpoint.

    Left alone, a quantiser in autograd keeps its rounded output and fp32 intermediates for the
    backward of every trained linear: 18.5 bytes per int4 weight element, ~9x the layer's bf16
    weights, for every layer until its backward (``bench/qat_memory.py``). Under the checkpoint it
    keeps only its input (the weight, which the layer holds anyway) and recomputes the rounding in
    the backward: the same deterministic ops, so the same values and gradients; the cost is one more
    element-wise pass over each weight (and fake-quantised input) per backward."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not (torch.is_grad_enabled() and x.requires_grad):
            return self.inner(x)  # nothing would be saved: no checkpoint needed
        from torch.utils.checkpoint import checkpoint

        return checkpoint(self.inner, x, use_reentrant=False)


_QUANTIZER_ATTRS = ("weight_fake_quantizer", "activation_fake_quantizer")


def recompute_quantizers(model: nn.Module) -> None:
    """Wrap the fake quantisers of torchao's ``FakeQuantizedLinear`` / ``FakeQuantizedEmbedding``
    in ``RecomputedQuantizer`` (the MX / NVFP4 linears already save only their packed inputs)."""
    from torchao.quantization.qat import FakeQuantizedEmbedding, FakeQuantizedLinear

    for module in model.modules():
        if isinstance(module, (FakeQuantizedLinear, FakeQuantizedEmbedding)):
            for attr in _QUANTIZER_ATTRS:
                quantizer = getattr(module, attr, None)
                if quantizer is not None and not isinstance(quantizer, RecomputedQuantizer):
                    setattr(module, attr, RecomputedQuantizer(quantizer))


def plain_quantizers(model: nn.Module) -> None:
    """Undo ``recompute_quantizers``: torchao's quantisers as they come (what ``bench/qat_memory.py
    --plain`` and the test of the recompute compare against)."""
    for module in model.modules():
        for attr in _QUANTIZER_ATTRS:
            quantizer = getattr(module, attr, None)
            if isinstance(quantizer, RecomputedQuantizer):
                setattr(module, attr, quantizer.inner)


def _quantizers(module: nn.Module) -> list[nn.Module]:
    found = [getattr(module, attr, None) for attr in _QUANTIZER_ATTRS]
    return [q.inner if isinstance(q, RecomputedQuantizer) else q for q in found if q is not None]


def fake_quantized_modules(model: nn.Module) -> list[nn.Module]:
    """The modules ``apply_qat`` swapped in."""
    from torchao.prototype.qat import MXFakeQuantizedLinear, NVFP4FakeQuantizedLinear
    from torchao.quantization.qat import FakeQuantizedEmbedding, FakeQuantizedLinear

    kinds = (FakeQuantizedLinear, FakeQuantizedEmbedding, MXFakeQuantizedLinear, NVFP4FakeQuantizedLinear)
    return [m for m in model.modules() if isinstance(m, kinds)]


def set_fake_quant(model: nn.Module, enabled: bool) -> None:
    """Switch every fake quantiser of ``model`` on or off (``fake_quant_after_n_steps``); off, the
    layers compute exactly as plain linears / embeddings."""
    for module in fake_quantized_modules(model):
        for quantizer in _quantizers(module):
            quantizer.enabled = enabled


def step_fake_quant(model: nn.Module, options: QATOptions, step: int) -> None:
    """Before optimizer step ``step`` (1-based): fake quantisation off for the first
    ``fake_quant_after_n_steps`` steps, on from then (as Axolotl's ``QATCallback``)."""
    if options.enabled and options.fake_quant_after_n_steps is not None:
        set_fake_quant(model, options.active_at(step))
