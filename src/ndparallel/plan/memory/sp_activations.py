"""Sequence-parallel block inputs in the activation model (``parallel/tp/sp_saves.py``).

Under TP each attention and each dense MLP block reads one input shared by its column-wise
linears (q, k, v; gate, up), which save it for their weight gradients. Without sequence parallel
it is the replicated residual stream: ``e·h`` per token and block on every tp rank. With sequence
parallel the runtime all-gathers it, and by default (``TPOptions.sequence_parallel_saved_shards``)
saves the rank's sequence shard instead and all-gathers it again in backward: ``e·h/t`` — what
Megatron keeps (Korthikanti et al. 2022). A mixture-of-experts block reads the rank's own rows
under SP (no gather) and keeps them as the MoE model says (``plan/moe_cost.py``).
"""

from __future__ import annotations

from ndparallel.layout.dims import ParallelDims
from ndparallel.plan.models import ModelSpec
from ndparallel.plan.settings import Settings


def block_input_divisor(layout: ParallelDims, s: Settings) -> int:
    """What divides a saved block input: tp with sequence parallel and saved shards, else 1.
    Under full activation checkpointing the checkpoint's hooks govern the layer (the runtime
    installs none of its own there): the recomputed layer saves its gathered inputs. The selective
    policy checkpoints only norms and the MLP activation, outside the blocks' own hooks: shards."""
    shards = s.sequence_parallel and s.sequence_parallel_saved_shards and not recomputes_layers(s)
    return layout.tp if shards and layout.tp > 1 else 1


def block_inputs_per_token(model: ModelSpec, layout: ParallelDims, s: Settings) -> float:
    """Bytes per local token one layer saves of its blocks' inputs: attention's, and the MLP's
    for a dense model (the MoE block's own rows are in ``plan/moe_cost.py``'s share)."""
    blocks = 1 if model.is_moe else 2
    extra_moe = s.act_bytes * model.hidden if model.is_moe else 0.0  # as modelled before: kept whole
    return blocks * s.act_bytes * model.hidden / block_input_divisor(layout, s) + extra_moe


def recompute_regathers_per_step(model: ModelSpec, layout: ParallelDims, s: Settings) -> int:
    """Extra all-gathers per micro-batch of the saved shards in backward: one per block (two per
    dense layer), none without SP or when checkpointing recomputes the blocks anyway."""
    if block_input_divisor(layout, s) == 1:
        return 0
    return (1 if model.is_moe else 2) * model.layers


def recomputes_layers(s: Settings) -> bool:
    """Whether backward runs each decoder layer's forward again (full checkpointing: its
    collectives and attention too); the selective policy recomputes only norms and the MLP
    activation, keeping the output of ``down_proj``'s collective (no collective runs again)."""
    return s.recompute in ("full", "op")
