"""QLoRA in the planner (``plan --adapter qlora``): LoRA (``plan.adapter``) on a base whose decoder
linears are 4-bit NF4 (``ndparallel.models.quantized``), and low-bit AdamW states.

What changes against LoRA on a bf16 base (h hidden, N_q the tp-local elements of one layer's seven
linears, n = dp_shard × cp, e compute bytes):

* parameters: the linears cost ``NF4_BYTES_PER_PARAM`` (0.5 + 1/64 byte) instead of e; embeddings,
  norms and the LM head stay in e. 70B: 68.5B linear params -> 35.3 GB, + 2.1 GB bf16 embeddings/head.
* FSDP all-gathers the NF4 bytes of a layer (``NF4Tensor``'s FSDP2 extension), ~e / 0.52 less traffic
  and gather buffer than the bf16 base.
* dequantisation: torchao's ``get_original_weight`` materialises, per weight, two int64 index tensors
  of numel/2 each, the two dequantised halves, the scaled halves and the stacked result:
  ``(8 + 3e)`` bytes per element of the largest linear alive at once (``DEQUANT_WORKSPACE``; 70B
  gate/up at tp 1: 235M elements -> 3.3 GB in bf16), once per weight in forward and again in backward
  (and in the recomputed forward under checkpointing): ``DEQUANT_TRAFFIC`` bytes moved per element.
* low-bit AdamW states on the adapters (``layout.OPTIMIZER_STATE_BYTES``).

The constants are read off torchao 0.18's code (bytes each op reads and writes); the workspace is
measured on CPU (``bench/qlora_memory.py``); no GPU timing of the dequantisation is claimed.
"""

from __future__ import annotations

import math

from ndparallel.layout.dims import ParallelDims
from ndparallel.models.nf4_config import NF4_BYTES_PER_PARAM
from ndparallel.plan.adapters.lora_cost import adapter_layer_local, adapter_shard_numel
from ndparallel.plan.models import ModelSpec
from ndparallel.plan.settings import Settings

NF4_GROUP = 64 * 256
"""Values per NF4 scaler group (torchao's defaults): a linear is stored as NF4 when made of whole groups."""

DEQUANT_WORKSPACE_INT = 8
"""Bytes per weight element of the two int64 index tensors (numel/2 each); + 3·e of float tensors."""
DEQUANT_TRAFFIC_INT = 17
"""Bytes moved per element by one dequantisation besides the float ones: reading the packed codes
twice (1), writing (8) and gathering through (8) the int64 indices; + 7·e for the float tensors
(halves, scales, products, the stacked copy)."""


def quantized_linears_local(model: ModelSpec, tp: int) -> list[int]:
    """tp-local element counts of one decoder layer's linear weights that NF4 stores (whole groups)."""
    out = []
    for p in model.param_specs():
        if p.unit == "layer" and len(p.shape) == 2 and p.numel % NF4_GROUP == 0:
            shape = list(p.shape)
            if p.tp_dim is not None:
                shape[p.tp_dim] = -(-shape[p.tp_dim] // tp)
            out.append(math.prod(shape))
    return out or [0]


def quantized_layer_local(model: ModelSpec, tp: int) -> int:
    return sum(quantized_linears_local(model, tp))


def quantized_shard_numel(model: ModelSpec, layout: ParallelDims) -> int:
    """NF4 elements one rank holds (all layers; FSDP-sharded)."""
    return model.layers * math.ceil(quantized_layer_local(model, layout.tp) / layout.fsdp)


def nf4_saving(numel: float, s: Settings) -> float:
    """Bytes saved by storing ``numel`` elements as NF4 instead of the compute dtype."""
    return numel * (s.param_compute_bytes - NF4_BYTES_PER_PARAM)


def dequant_workspace_bytes(model: ModelSpec, layout: ParallelDims, s: Settings) -> float:
    """The transient of dequantising the largest linear once (see the module doc)."""
    return (DEQUANT_WORKSPACE_INT + 3 * s.act_bytes) * max(quantized_linears_local(model, layout.tp))


def dequant_seconds(model: ModelSpec, layout: ParallelDims, s: Settings, bandwidth: float) -> float:
    """Memory-bound seconds of one step's dequantisations: every NF4 weight, once in forward, once
    in backward, once more in a checkpointed layer's recomputed forward, per micro-batch."""
    passes = 3 if s.activation_checkpointing else 2
    per_element = DEQUANT_TRAFFIC_INT + 7 * s.act_bytes
    return (
        s.gradient_accumulation_steps
        * passes
        * model.layers
        * quantized_layer_local(model, layout.tp)
        * per_element
        / bandwidth
    )


def nf4_shards_problem(model: ModelSpec, layout: ParallelDims, group: int = NF4_GROUP) -> str | None:
    """The runtime's refusal (``models.quantized.layout_problem``) on the model's NF4 weights: every
    FSDP shard is whole rows and whole 16,384-value scaler groups; TP is refused."""
    from ndparallel.models.quantized import layout_problem

    counts = {
        p.name: math.gcd(p.shape[0], p.numel // group)
        for p in model.param_specs()
        if p.unit == "layer" and len(p.shape) == 2 and p.numel % group == 0
    }
    return layout_problem(counts, layout.fsdp, layout.tp) if counts else None


def memory_adjustments(
    model: ModelSpec, layout: ParallelDims, s: Settings, layer_local: int
) -> dict[str, float]:
    """Bytes ``estimate_memory`` subtracts from a LoRA estimate on a bf16 base (``params``: the NF4
    shards; ``buffer_a`` / ``buffer_b``: the gathered layers of the loss / layer-backward moments)
    and adds (``workspace``: one dequantisation, at the layer-backward moment)."""
    q_local = quantized_layer_local(model, layout.tp)
    gathered = (1 + s.prefetch) if layout.fsdp > 1 or s.mixed_precision != "fp32" else 0
    kept = 0.0 if s.reshard_after_forward else model.layers
    return {
        "params": nf4_saving(quantized_shard_numel(model, layout), s),
        "buffer_a": nf4_saving(q_local * kept, s) if gathered else 0.0,
        "buffer_b": nf4_saving(q_local * (gathered + max(kept - 1 - s.prefetch, 0)), s) if gathered else 0.0,
        "workspace": dequant_workspace_bytes(model, layout, s),
    }


def nf4_collectives(cs: list, model: ModelSpec, layout: ParallelDims, s: Settings) -> list:
    """FSDP all-gathers of a layer carry its NF4 bytes instead of compute-dtype ones."""
    from dataclasses import replace

    shard = math.ceil(quantized_layer_local(model, layout.tp) / layout.fsdp)
    return [
        replace(c, bytes=c.bytes - nf4_saving(shard, s), what=c.what + ", NF4 base")
        if c.what == "FSDP all-gather params (layer)"
        else c
        for c in cs
    ]


def fsdp_copy_bytes_qlora(
    model: ModelSpec, layout: ParallelDims, s: Settings, local: float, shard: float
) -> float:
    """FSDP2's own copies per step with an NF4 base (``membound.fsdp_copy_bytes`` for this case): the
    all-gather inputs are the NF4 tensors' bytes as stored (no cast; read and written once into the
    send buffer), the gathered bytes are copied out once per gather; only adapter gradients are
    reduced and accumulated."""

    if not (layout.dp_replicate * layout.fsdp > 1 or s.mixed_precision != "fp32"):
        return 0.0
    e = s.act_bytes
    local_b = local * e - nf4_saving(model.layers * quantized_layer_local(model, layout.tp), s)
    shard_b = shard * e - nf4_saving(quantized_shard_numel(model, layout), s)
    gathers = s.gathers_per_step()
    adapter_local = model.layers * adapter_layer_local(model, s.lora_r, layout.tp)
    reduce = s.reducing_microbatches * adapter_local * (e + 4)
    accumulate = adapter_shard_numel(model, layout, s.lora_r) * 12 * (s.gradient_accumulation_steps - 1)
    return gathers * 2 * (shard_b + local_b) + reduce + accumulate
