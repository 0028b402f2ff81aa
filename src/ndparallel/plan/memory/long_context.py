"""What the long-context memory options change in the planner's model (docs/planner.md, *Long
context*), per local token ``T = b·s/c`` of one micro-batch on one GPU.

**Sequence-tiled MLP** (``techniques/tiled_mlp.py``): a layer no longer keeps gate, SiLU(gate), up
and their product (``4·e·f/t`` per token) and keeps the MLP input sharded under sequence parallel
(``e·h/t_sp`` instead of the gathered ``e·h``); one tile's working set exists in its backward:
the recomputed four intermediates and their gradients (``7·e·f/t``) and the gathered tile input
(``e·h``) per tile token. Time: the MLP forward runs once more (the tile recomputed in backward;
with checkpointing the layer's recompute runs the tiled forward whole, down-projection included),
its GEMMs at the tile's shape, and under TP the MLP's forward collectives once more.

**Lean norms** (``techniques/lean_norm.py``, on with the tiled MLP): an RMSNorm keeps its input (``e``
per value) and one fp32 rstd per row instead of HF's fp32 input, normalised output and rstd
(``(4+e)`` per value + 4), and its backward holds one token tile's fp32 temporaries (``16·h`` per
tile token) instead of five fp32 copies of its input (``plan/memory/activations.py``).

**Activation offloading** (``techniques/offload.py``, needs checkpointing). Full checkpointing:
the ``L`` checkpointed layer inputs (``e·h/t_sp`` per token each) live in host memory; on the
device at most ``offload_in_flight`` (2) of them at any moment. Selective checkpointing
(``techniques/selective_ac.py``): saved-tensor hooks around each layer's forward move every tensor
the layer saves to host memory but the output of ``down_proj``'s collective, which the policy keeps
itself under TP (``selective_offload_residue_per_token``), and tensors under 1 KiB (not counted);
in backward one layer's set comes back at a time (``plan/memory/activations.py: offload_split_per_token``).
Host memory holds every micro-batch in flight (a pipeline's first rank ~``p`` of them). Time: per
layer a device→host copy overlapping a forward and a host→device copy overlapping a backward, at
``Hardware.host_link_bw``; only what exceeds that compute is exposed (``offload_exposed_seconds``).
"""

from __future__ import annotations

from ndparallel.layout.dims import ParallelDims
from ndparallel.plan.memory.sp_activations import block_input_divisor
from ndparallel.plan.models import ModelSpec
from ndparallel.plan.settings import Settings
from ndparallel.techniques.tile_rule import tile_split


def _t_sp(layout: ParallelDims, s: Settings) -> int:
    return layout.tp if s.sequence_parallel and layout.tp > 1 else 1


def mlp_tiles(model: ModelSpec, layout: ParallelDims, s: Settings) -> tuple[int, float]:
    """(tiles per MLP call, tokens of one tile after the tp all-gather, all rows of the
    micro-batch): the runtime cuts the MLP input's local rows (``s/(c·t_sp)`` tokens) into
    ``tiled_mlp_num_shards`` or ``ceil(rows / h)`` tiles."""
    t_sp = _t_sp(layout, s)
    row = max(1, s.sequence_len // layout.cp // t_sp)
    n, tile = tile_split(row, model.hidden, s.tiled_mlp_num_shards)
    return n, s.micro_batch_size * tile * t_sp


def norm_saved_per_row(width: float, s: Settings) -> float:
    """Bytes one RMSNorm saves per row of ``width`` values: HF's ``(4+e)·width + 4``; lean (with the
    tiled MLP) its input and rstd, ``e·width + 4``."""
    return (s.act_bytes if s.tiled_mlp else 4 + s.act_bytes) * width + 4


def lean_norm_tile_bytes(model: ModelSpec, layout: ParallelDims, s: Settings) -> float | None:
    """A lean norm's backward working set: four fp32 ``[tile, h]`` tensors (``16·h`` per tile token;
    measured, ``tests/test_lean_norm.py``), the tile cut from the micro-batch's local rows by the
    tiled MLP's rule. None without the tiled MLP (HF's norm)."""
    if not s.tiled_mlp:
        return None
    rows = max(1, s.micro_batch_size * s.sequence_len // layout.cp // _t_sp(layout, s))
    _, tile = tile_split(rows, model.hidden, s.tiled_mlp_num_shards)
    return 16 * tile * model.hidden


def tiled_saved_reduction_per_token(model: ModelSpec, layout: ParallelDims, s: Settings) -> float:
    """Bytes per local token one layer does not keep for backward with the tiled MLP."""
    if not s.tiled_mlp:
        return 0.0
    e, t = s.act_bytes, layout.tp
    kept_input = e * model.hidden / block_input_divisor(layout, s)  # what the MLP's input costs untiled
    return 4 * e * model.intermediate / t + kept_input - e * model.hidden / _t_sp(layout, s)


def tile_working_set(model: ModelSpec, layout: ParallelDims, s: Settings) -> float:
    """Bytes of one tile's backward: 7·e·f/t + e·h per tile token (0 without tiling)."""
    if not s.tiled_mlp:
        return 0.0
    _, tile = mlp_tiles(model, layout, s)
    e = s.act_bytes
    return tile * (7 * e * model.intermediate / layout.tp + e * model.hidden)


def mlp_gradient_workspace_per_token(model: ModelSpec, layout: ParallelDims, s: Settings) -> float:
    """The MLP part (gate, up and product gradients, ``3·e·f/t``) of a layer's backward workspace
    per token; tiled, it exists per tile only (in ``tile_working_set``)."""
    return 3 * s.act_bytes * model.intermediate / layout.tp


def checkpointed_input_per_token(model: ModelSpec, layout: ParallelDims, s: Settings) -> float:
    return s.act_bytes * model.hidden / _t_sp(layout, s)


def device_checkpointed_layers(model: ModelSpec, s: Settings) -> int:
    """Checkpointed layer inputs on the device at the peak: all of them, or with offloading the
    ones in flight."""
    return min(model.layers, s.offload_in_flight) if s.activation_offloading else model.layers


def offloading(s: Settings) -> bool:
    """Whether activation offloading runs: it offloads what checkpointing keeps."""
    return s.activation_offloading and s.activation_checkpointing


def selective_offload_residue_per_token(model: ModelSpec, layout: ParallelDims, s: Settings) -> float:
    """Bytes per local token and layer that stay on the device when selective checkpointing
    offloads: under TP the output of ``down_proj``'s collective (``e·h/t_sp``), which the
    policy's own checkpoint context keeps, out of the saved-tensor hooks' reach; else nothing."""
    return s.act_bytes * model.hidden / _t_sp(layout, s) if layout.tp > 1 else 0.0


FORWARD_SHARE = {"full": 1 / 4, "selective": 1 / 3}
"""A layer's forward in its micro-batch's compute: full checkpointing runs forward 1, recompute 1,
backward 2; selective recomputes no whole layer (forward 1, backward 2; its norms' and SwiGLU's
recompute are small)."""


def offload_exposed_seconds(
    model: ModelSpec,
    layout: ParallelDims,
    s: Settings,
    host_link_bw: float,
    micro_batch_seconds: float,
    layer_bytes: float,
) -> float:
    """Copy time per micro-batch not hidden behind compute: per layer a device→host copy of its
    ``layer_bytes`` (one layer's offloaded bytes of one micro-batch) against a layer's forward
    (``FORWARD_SHARE`` of its compute) and a host→device copy against a layer's backward (with
    full checkpointing its recompute too: the rest)."""
    if not offloading(s) or not layer_bytes:
        return 0.0
    per_layer = layer_bytes / host_link_bw
    layer_compute = micro_batch_seconds / model.layers
    forward = layer_compute * FORWARD_SHARE.get(s.recompute, FORWARD_SHARE["full"])
    return model.layers * (max(0.0, per_layer - forward) + max(0.0, per_layer - (layer_compute - forward)))


def tiled_tp_extra(model: ModelSpec, layout: ParallelDims, s: Settings, tokens: int, ga: int) -> list[tuple]:
    """Extra TP collectives of the tiled MLP per step, as (kind, bytes, calls, what): the tiles'
    recomputed forward repeats the MLP input's all-gather (sequence parallel) and its output's
    reduction; under checkpointing the layer's recompute also runs the output's reduction, which
    the untiled recompute skips (the checkpoint stops before it). Tiling itself splits each call
    into tiles of the same total bytes (the per-call latencies of the tiles are not modelled)."""
    if not s.tiled_mlp or layout.tp == 1:
        return []
    full = tokens * model.hidden * s.act_bytes
    reductions = (1 + (1 if s.activation_checkpointing else 0)) * model.layers * ga
    if s.sequence_parallel:
        return [
            ("all_gather", full // layout.tp, model.layers * ga, "TP/SP all-gather (tiled MLP recompute)"),
            ("reduce_scatter", full, reductions, "TP/SP reduce-scatter (tiled MLP recompute)"),
        ]
    return [("all_reduce", full, reductions, "TP all-reduce (tiled MLP recompute)")]
