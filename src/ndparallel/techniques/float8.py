"""Float8 training of the decoder layers' linears with torchao (``Float8Linear``).

Applied first, before TP and FSDP (as torchtitan does): every ``nn.Linear`` inside a decoder layer
whose dimensions are multiples of 16 (what the fp8 matmul needs) becomes a torchao
``Float8Linear``; embeddings, norms and the LM head stay in the training dtype. Recipes:
``tensorwise`` (one dynamic scale per tensor; with FSDP2 the weights are all-gathered in float8)
and ``rowwise`` (one scale per row: more accurate, all-gathered in bf16). Matmuls run through
``torch._scaled_mm`` on GPUs of compute capability >= 8.9; ``emulate`` runs the same casts with
high-precision matmuls on any device (tests).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn as nn

from ndparallel.models.layers import decoder_layers
from ndparallel.runtime.extras import EXTRAS, absent, install_line, require
from ndparallel.techniques.technique_options import Float8Options

MIN_CAPABILITY = (8, 9)


def float8_problem(options: Float8Options, device_type: str) -> str | None:
    """Why float8 training cannot run here (None when it can): torchao missing, or no GPU with
    compute capability >= 8.9 (unless ``emulate``)."""
    if not options.enabled:
        return None
    missing = install_line([("fp8", "float8 training", absent(EXTRAS["fp8"]))])
    if missing:
        return missing
    if options.emulate:
        return None
    if device_type != "cuda" or not torch.cuda.is_available():
        return (
            "fp8 needs a CUDA GPU with compute capability >= 8.9 (H100/H200, L40S, RTX 4090); "
            "this run has none: set fp8: false"
        )
    cap = torch.cuda.get_device_capability()
    if cap < MIN_CAPABILITY:
        return (
            f"fp8 needs compute capability >= 8.9; {torch.cuda.get_device_name()} has "
            f"{cap[0]}.{cap[1]}: set fp8: false"
        )
    return None


def apply_float8(
    model: nn.Module, options: Float8Options, layer_classes=None, fsdp: bool = True
) -> nn.Module:
    """Swap the decoder layers' linears for torchao ``Float8Linear`` in place; return the model."""
    require("fp8", "float8 training")
    problem = float8_problem(options, "cuda" if torch.cuda.is_available() else "cpu")
    if problem:
        raise RuntimeError(problem)
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    config = Float8LinearConfig.from_recipe_name(options.recipe)
    config = dataclasses.replace(
        config,
        emulate=options.emulate,
        enable_fsdp_float8_all_gather=fsdp
        and options.recipe == "tensorwise"
        and options.fsdp_float8_all_gather,
    )
    inside = {id(m) for layer in decoder_layers(model, layer_classes) for m in layer.modules()}

    def convert(module: nn.Module, name: str) -> bool:
        # LoRA's A / B stay in the training dtype: r × d matmuls gain nothing from fp8 and would
        # lose precision; the frozen base linear they wrap (``base_layer``) is converted.
        return (
            id(module) in inside
            and isinstance(module, nn.Linear)
            and ".lora_" not in f".{name}"
            and module.in_features % 16 == 0
            and module.out_features % 16 == 0
        )

    return convert_to_float8_training(model, module_filter_fn=convert, config=config)


def precompute_scales(model: nn.Module, options: Float8Options) -> None:
    """After ``optimizer.step()``: compute every float8 weight's scale in one all-reduce (tensorwise
    recipe with float8 all-gather), instead of one per weight in the next forward."""
    if options.enabled and options.recipe == "tensorwise" and options.fsdp_float8_all_gather:
        from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

        precompute_float8_dynamic_scale_for_fsdp(model)
