"""4-bit NormalFloat (NF4) frozen base weights for QLoRA, through torchao's ``NF4Tensor``.

The NF4 format is torchao's (the one torchtune's QLoRA trains with): each weight is cut into
blocks of ``block_size`` values (64), each stored as 4-bit indices into the 16 NormalFloat levels
times the block's absmax; the absmaxes are themselves quantised to int8 ("double quantisation",
about their mean, one fp scale per ``scaler_block_size`` (256) of them). A weight therefore costs
0.5 byte per value + 1 byte per 64 values + one scale per 16,384 values: ~0.516 byte/param.
``NF4Tensor`` implements FSDP2's ``fsdp_pre_all_gather`` / ``fsdp_post_all_gather``: FSDP2 shards
its packed bytes along dim 0 and all-gathers the 4-bit data (not a dequantised copy) before each
layer runs; its ``F.linear`` dequantises to the input's dtype and saves only the NF4 weight for
backward.

Which weights: every ``nn.Linear`` except the output head (``lm_head``) and the leaf names in
``NF4Config.skip_modules`` — as bitsandbytes' ``load_in_4bit`` does (embeddings, norms and the head
stay in the load dtype). A weight whose size is not a whole number of scaler blocks
(``block_size · scaler_block_size`` = 16,384 values) stays in the load dtype: this depends on the
model only, never on the layout, so every layout computes the same model.

Exactness of shard-wise quantisation (``quantize_row_shard``): a block's 4-bit codes and absmax
depend on that block only, and the int8 quantisation of the absmaxes on their scaler block and on
the **mean of all the weight's absmaxes**. A rank holding whole scaler blocks of rows therefore
quantises its rows exactly as ``to_nf4`` quantises the whole weight, given the whole weight's
mean: the ranks all-gather their block absmaxes (1/64 of the weight's values) and take the same
``mean()`` of the same vector. Bit-identical to ``to_nf4(full)`` chunked (tested).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn as nn

from ndparallel.models.nf4_config import NF4Config
from ndparallel.runtime.extras import require


def nf4_module():
    """torchao's NF4 module (``torchao.quantization.quantize_.workflows.nf4.nf4_tensor`` since 0.15-ish,
    ``torchao.dtypes.nf4tensor`` before)."""
    require("qlora", "QLoRA (a 4-bit NF4 base)", ("torchao",))
    try:
        from torchao.quantization.quantize_.workflows.nf4 import nf4_tensor
    except ImportError:
        from torchao.dtypes import nf4tensor as nf4_tensor
    return nf4_tensor


def require_torchao():
    """(``NF4Tensor``, ``to_nf4``) from torchao; ImportError with the pip line when it is missing."""
    module = nf4_module()
    return module.NF4Tensor, module.to_nf4


def is_nf4(tensor: Any) -> bool:
    """An ``NF4Tensor``, or a DTensor whose local shard is one (duck-typed: no torchao import)."""
    local = getattr(tensor, "_local_tensor", tensor)
    return type(local).__name__ == "NF4Tensor" and hasattr(local, "quantized_data")


def nf4_parameter_names(model: nn.Module) -> list[str]:
    return [n for n, p in model.named_parameters() if is_nf4(p)]


def quantizable(weight_shape: tuple[int, ...] | torch.Size, config: NF4Config) -> bool:
    """Whether a linear weight of this shape is stored as NF4 (2-D, whole scaler blocks)."""
    return len(weight_shape) == 2 and math.prod(weight_shape) % config.group == 0


def _in_saved_module(name: str) -> bool:
    """Inside a LoRA ``modules_to_save`` wrapper (trained in full: never quantised)."""
    return ".original_module" in f".{name}." or ".modules_to_save." in f".{name}."


def quantized_linears(model: nn.Module, config: NF4Config) -> tuple[list[str], list[str]]:
    """(linears quantised, linears left in the load dtype because of their size), by module name:
    every ``nn.Linear`` but the output head, LoRA's ``modules_to_save`` and ``config.skip_modules``."""
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    out, kept = [], []
    for name, m in model.named_modules():
        if not isinstance(m, nn.Linear) or m is head or ".lora_" in f".{name}" or _in_saved_module(name):
            continue
        if name.rsplit(".", 1)[-1] in config.skip_modules:
            continue
        (out if quantizable(m.weight.shape, config) else kept).append(name)
    return out, kept


@torch.no_grad()
def quantize_linears(model: nn.Module, config: NF4Config) -> list[str]:
    """Replace the weights of ``quantized_linears`` by frozen NF4 tensors (torchao's ``to_nf4``), in
    place, on whatever device they are (meta included: the layout to shard). Returns the module
    names. The whole of each weight is quantised here: for a model built in memory on each rank;
    ``load_model`` quantises each rank's shard while reading it (``quantized_loading``)."""
    _, to_nf4 = require_torchao()
    names, _ = quantized_linears(model, config)
    modules = dict(model.named_modules())
    for name in names:
        linear = modules[name]
        nf4 = to_nf4(linear.weight.detach(), config.block_size, config.scaler_block_size)
        linear.weight = nn.Parameter(nf4, requires_grad=False)
        if linear.bias is not None:
            linear.bias.requires_grad_(False)
    return names


def _block_absmax(values: torch.Tensor, block: int) -> torch.Tensor:
    return nf4_module().get_block_absmax(values, block)


@torch.no_grad()
def nf4_with_mean(rows: torch.Tensor, absmax_mean: torch.Tensor, config: NF4Config):
    """NF4 of ``rows`` (whole scaler blocks of a weight) with the whole weight's absmax mean: the
    4-bit codes from torchao's ``to_nf4`` (per block), the double-quantised scales recomputed about
    ``absmax_mean`` — what ``NF4Tensor.double_quantize_scalers`` does about the mean of the tensor
    it sees, which for a shard is not the weight's."""
    _, to_nf4 = require_torchao()
    nf4 = to_nf4(rows, config.block_size, config.scaler_block_size)
    centred = _block_absmax(rows.flatten(), config.block_size) - absmax_mean
    scale = 256 / (2 * _block_absmax(centred, config.scaler_block_size))
    codes = (centred.view(-1, config.scaler_block_size) * scale.unsqueeze(-1)).round().clamp(-128, 127)
    nf4.quantized_scalers = codes.flatten().to(torch.int8)
    nf4.quantization_factor = scale.contiguous()
    nf4.scaler_mean = absmax_mean
    return nf4


@torch.no_grad()
def quantize_row_shard(rows: torch.Tensor, config: NF4Config, group=None):
    """NF4 of this rank's rows of a weight, bit-identical to the matching dim-0 chunk of
    ``to_nf4(full weight)``. ``group``: the process group the rows are sharded over (chunk i on the
    group's rank i, equal chunks of whole scaler blocks); None or size 1: ``rows`` is the weight."""
    import torch.distributed as dist

    _, to_nf4 = require_torchao()
    if group is None or dist.get_world_size(group) == 1:
        return to_nf4(rows, config.block_size, config.scaler_block_size)
    if rows.numel() % config.group:
        raise ValueError(
            f"a shard of {tuple(rows.shape)} is not a whole number of NF4 scaler blocks "
            f"({config.group} values)"
        )
    absmax = _block_absmax(rows.flatten(), config.block_size)
    every = absmax.new_empty(absmax.numel() * dist.get_world_size(group))
    dist.all_gather_into_tensor(every, absmax.contiguous(), group=group)
    return nf4_with_mean(rows, every.mean(), config)


def dequantize(tensor: torch.Tensor) -> torch.Tensor:
    """The high-precision values (in its dtype) of an ``NF4Tensor``; any other tensor as is.

    A DTensor of NF4 shards: every rank dequantises its own shard (whole rows and scaler blocks, the
    tensor's scaler mean: the same values as dequantising the whole), then the plain values are
    gathered (collective). The 4-bit shards themselves are not gathered: that goes through
    torchao's override of the functional all-gather, which was seen to corrupt the heap
    (``malloc(): unaligned tcache chunk``) and to hang on gloo ranks. Costs the dequantised
    tensor's bytes on the wire instead of 4-bit ones; the whole dequantised tensor exists anyway.
    """
    if is_nf4(tensor) and hasattr(tensor, "to_local"):
        from torch.distributed.tensor import DTensor

        with torch.no_grad():
            local = tensor.to_local().get_original_weight()
            return DTensor.from_local(
                local,
                tensor.device_mesh,
                tensor.placements,
                run_check=False,
                shape=tensor.shape,
                stride=tensor.stride(),
            ).full_tensor()
    return tensor.get_original_weight() if is_nf4(tensor) else tensor


def nf4_shard_count(shape: tuple[int, ...] | torch.Size, config: NF4Config) -> int:
    """The largest number of FSDP shards an NF4 weight of ``shape`` splits into (whole rows and whole
    scaler blocks per shard, as torchao's split needs); any divisor of it works too."""
    return math.gcd(shape[0], math.prod(shape) // config.group)


def nf4_shard_counts(model: nn.Module) -> dict[str, int]:
    """``nf4_shard_count`` of every NF4 weight of ``model``, by parameter name."""
    out = {}
    for name, p in model.named_parameters():
        if is_nf4(p):
            local = getattr(p, "_local_tensor", p)
            out[name] = nf4_shard_count(p.shape, NF4Config(local.block_size, local.scaler_block_size))
    return out


def nf4_layout_problem(model: nn.Module, fsdp_shards: int, tp_size: int) -> str | None:
    """Why ``model``'s NF4 weights cannot run on this layout (None: they can), with the fix."""
    return layout_problem(nf4_shard_counts(model), fsdp_shards, tp_size)


def layout_problem(shard_counts: dict[str, int], fsdp_shards: int, tp_size: int) -> str | None:
    """``nf4_layout_problem`` from the weights' ``nf4_shard_count``s (no model needed)."""
    if not shard_counts:
        return None
    if tp_size > 1:
        return (
            "a 4-bit NF4 base (QLoRA) with tensor_parallel_size > 1 is not supported (torchao's NF4 tensor "
            "shards along FSDP's dim 0 only): set tensor_parallel_size: 1 and give the GPUs to "
            "dp_shard_size (a 70B NF4 base is ~37 GB: FSDP 2 holds it), or use adapter: lora for TP"
        )
    bad = [n for n, c in shard_counts.items() if c % fsdp_shards]
    if bad:
        divisor = math.gcd(*shard_counts.values())
        return (
            f"the NF4 weights cannot be split into {fsdp_shards} FSDP shards (dp_shard_size x "
            f"context_parallel_size) of whole rows and whole NF4 scaler blocks, e.g. {bad[0]} "
            f"(at most {shard_counts[bad[0]]}): use a shard count dividing {divisor}, or smaller NF4 blocks "
            "(nf4_scaler_block_size)"
        )
    return None
