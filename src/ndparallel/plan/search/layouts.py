"""The layouts the search tries (the runtime's ``ParallelDims``: pp, dp_replicate, dp_shard, cp, tp,
ep) and why a layout cannot run at all (before its memory is counted)."""

from __future__ import annotations

from ndparallel.layout.dims import ParallelDims
from ndparallel.plan.models import ModelSpec
from ndparallel.plan.settings import Settings


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def pipeline_degrees(world: int, layers: int) -> list[int]:
    """The pp degrees the search tries: 1 and the powers of two dividing ``world``, at most
    ``layers`` (every stage needs a layer)."""
    return [1] + [2**k for k in range(1, world.bit_length()) if world % 2**k == 0 and 2**k <= layers]


def enumerate_layouts(world: int, experts: int = 0, layers: int = 0) -> list[ParallelDims]:
    """Every (dp_replicate, dp_shard, cp, tp) with product ``world``; for a model with ``experts``
    per layer also every expert-parallel degree dividing both dp_shard·cp·tp and ``experts``. With
    ``layers`` (a dense model's decoder layers) also pipeline parallel: every such layout of
    ``world / pp`` ranks for each of ``pipeline_degrees``."""
    out = []
    for pp in pipeline_degrees(world, layers) if layers and not experts else [1]:
        stage = world // pp
        for tp in divisors(stage):
            for cp in divisors(stage // tp):
                for ds in divisors(stage // (tp * cp)):
                    eps = [e for e in divisors(ds * cp * tp) if experts % e == 0] if experts else [1]
                    out += [ParallelDims(stage // (tp * cp * ds), ds, cp, tp, ep, pp) for ep in eps]
    return out


def structural_rejections(
    layout: ParallelDims, model: ModelSpec, world: int, gpus_per_node: int, settings: Settings
) -> list[tuple[str, str]]:
    """Why ``layout`` cannot run at all (before memory): a list of (code, message); empty if ok."""
    out: list[tuple[str, str]] = []
    if layout.world != world:
        out.append(
            (
                "world_size",
                f"{'pp × ' if layout.pp_enabled else ''}dp_replicate × dp_shard × cp × tp = "
                f"{layout.compact()} = {layout.world} ranks, but the world has {world}",
            )
        )
    tp, cp = layout.tp, layout.cp
    if tp > gpus_per_node:
        out.append(
            (
                "tp_beyond_node",
                f"tp={tp} is larger than a node ({gpus_per_node} GPUs): "
                "TP collectives would cross the inter-node network every layer",
            )
        )
    elif tp > 1 and gpus_per_node % tp:
        out.append(
            (
                "tp_beyond_node",
                f"tp={tp} does not divide the {gpus_per_node} GPUs of a "
                "node: some TP groups would straddle two nodes",
            )
        )
    if model.heads % tp:
        out.append(("heads", f"{model.heads} attention heads are not divisible by tp={tp}"))
    if model.kv_heads % tp:
        out.append(("kv_heads", f"{model.kv_heads} key/value heads are not divisible by tp={tp}"))
    if model.intermediate % tp:
        out.append(("ffn", f"intermediate size {model.intermediate} is not divisible by tp={tp}"))
    if layout.ep > 1 and not model.is_moe:
        out.append(("ep_dense", f"ep={layout.ep}: {model.name} has no experts to split"))
    elif model.is_moe and model.num_experts % layout.ep:
        out.append(("ep_experts", f"ep={layout.ep} does not divide the {model.num_experts} experts"))
    if (
        cp > 1
        and settings.cp_comm_strategy == "ulysses"
        and model.heads % tp == 0
        and model.kv_heads % tp == 0
    ):
        h, kv = model.heads // tp, model.kv_heads // tp
        if h % cp or (kv % cp and cp % kv):
            out.append(
                (
                    "heads_cp",
                    f"cp_strategy ulysses needs the {h} query heads per tp rank "
                    f"divisible by cp={cp} and the {kv} key/value heads per tp rank dividing "
                    "or divisible by it",
                )
            )
    if layout.pp_enabled:
        out += pipeline_rejections(layout, model, settings)
    if settings.sequence_len % layout.cp_chunks():
        out.append(
            (
                "seq_cp",
                f"seq_len {settings.sequence_len} is not divisible by 2·cp = {2 * cp} "
                "(load-balanced CP cuts each sequence into 2·cp chunks)",
            )
        )
    elif settings.sequence_len % layout.seq_len_divisor(settings.sequence_parallel):
        out.append(
            (
                "seq_tp",
                f"the {settings.sequence_len // cp} tokens per cp rank are not divisible "
                f"by tp={tp} (sequence parallel splits them over tp)",
            )
        )
    return out


def pipeline_rejections(layout: ParallelDims, model: ModelSpec, settings: Settings) -> list[tuple[str, str]]:
    """What a pp layout cannot be, whatever its micro-batches (those: ``pipeline.problem``)."""
    out = []
    if layout.pp > model.layers:
        out.append(
            ("pp_layers", f"pp={layout.pp} stages for {model.layers} decoder layers: every stage needs one")
        )
    if model.is_moe:
        out.append(
            (
                "pp_moe",
                f"pp={layout.pp} with experts: pipeline parallel of MoE models is not "
                "modelled (train refuses it with a router loss)",
            )
        )
    if settings.lora_r:
        out.append(
            (
                "pp_adapter",
                f"pp={layout.pp} with a LoRA adapter: not modelled by the planner (train runs "
                "it: docs/pipeline_parallel.md)",
            )
        )
    return out
