"""Communication model: every collective of one training step (its alpha-beta ring cost on the
links: ``plan/time/links.py``).

Convention: ``Collective.bytes`` is the size of the tensor one rank passes *into* one call (the
local shard for all-gather, the full tensor for reduce-scatter and all-reduce, the buffer sent
for send/recv); ``count`` is calls per rank per optimizer step (all micro-batches).
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass
from functools import lru_cache
from operator import attrgetter

from ndparallel.layout.dims import ParallelDims
from ndparallel.plan import moe_cost
from ndparallel.plan.adapters.lora_cost import adapt_collectives
from ndparallel.plan.adapters.qlora import nf4_collectives
from ndparallel.plan.field_hash import cached_field_hash
from ndparallel.plan.memo import Memo
from ndparallel.plan.memory.long_context import tiled_tp_extra
from ndparallel.plan.memory.sp_activations import recompute_regathers_per_step, recomputes_layers
from ndparallel.plan.models import ModelSpec, ParamSpec, fsdp_units
from ndparallel.plan.moe_cost import expert_unit_numels
from ndparallel.plan.settings import COLLECTIVE_FIELDS, Settings

KINDS = ("all_gather", "reduce_scatter", "all_reduce", "send_recv", "all_to_all")


@dataclass(frozen=True)
class Collective:
    """One kind of call: ``count`` calls per step, each with ``bytes`` in per rank."""

    kind: str
    mesh_dim: str
    bytes: int
    count: int
    what: str
    overlap: str = "none"
    """What it can hide behind: 'compute' (FSDP/DP, prefetched), 'attention' (CP ring), 'none'."""

    def __hash__(self) -> int:
        return cached_field_hash(self)  # the key of ``cost``'s cache, asked ~200,000 times a search


# ----------------------------------------------------------------- shapes
def tp_local_shape(p: ParamSpec, tp: int) -> tuple[int, ...]:
    """Local shape on one tp rank (uneven splits take the larger piece)."""
    if p.tp_dim is None or tp == 1:
        return p.shape
    s = list(p.shape)
    s[p.tp_dim] = math.ceil(s[p.tp_dim] / tp)
    return tuple(s)


def fsdp_shard_numel(p: ParamSpec, tp: int, fsdp: int) -> int:
    """Elements of one FSDP2 shard: dim 0 of the tp-local tensor split into ``fsdp`` chunks,
    padded to equal size (FSDP2's all-gather input per rank)."""
    shape = tp_local_shape(p, tp)
    rest = 1
    for d in shape[1:]:
        rest *= d
    return math.ceil(shape[0] / fsdp) * rest


def unit_numels(
    model: ModelSpec, tp: int, fsdp: int, layout: ParallelDims | None = None
) -> dict[str, tuple[int, int]]:
    """FSDP unit -> (tp-local unsharded elements, padded shard elements) of ONE such unit. An MoE
    model's ``experts`` unit: this rank's E/ep experts and their shard over efsdp (``layout``;
    default: experts not split, sharded over ``fsdp`` like the rest). Cached (the search's hot
    spot); the caller gets its own dict."""
    return dict(_unit_numels(model, tp, fsdp, layout if model.is_moe else None))


@lru_cache(maxsize=4096)
def _unit_numels(
    model: ModelSpec, tp: int, fsdp: int, layout: ParallelDims | None
) -> dict[str, tuple[int, int]]:
    out: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    if model.is_moe:
        out["experts"] = list(expert_unit_numels(model, layout or ParallelDims(dp_shard=fsdp)))
    for p in model.param_specs():
        if p.unit == "experts":
            continue
        local = 1
        for d in tp_local_shape(p, tp):
            local *= d
        out[p.unit][0] += local
        out[p.unit][1] += fsdp_shard_numel(p, tp, fsdp)
    return {k: (v[0], v[1]) for k, v in out.items()}


# ----------------------------------------------------------- prediction
def predict_collectives(
    model: ModelSpec, layout: ParallelDims, sequence_len: int, scalars: bool = False, **settings
) -> list[Collective]:
    """Every collective one rank issues in one optimizer step (see docs/planner.md), under the
    ``Settings`` of ``sequence_len`` and ``settings`` (each by its field name; the others at their
    defaults).

    ``scalars``: also list the small ones of the training loop (``train_under_layout`` /
    ``ndparallel.training.trainer``): the global token count and the gradient norm (see
    ``scalar_collectives``).
    """
    s = Settings(sequence_len=sequence_len, **settings)
    out = collectives_for(model, layout, s)
    if scalars:
        out += scalar_collectives(model, layout, s.mixed_precision)
    return out


def collectives_for(
    model: ModelSpec, layout: ParallelDims, s: Settings, with_data_parallel: bool = True
) -> list[Collective]:
    """Every collective of one rank's step (``with_data_parallel`` False: but FSDP's and DDP's,
    where no adapter changes them: what the search's TP floor asks, ``estimate.exposed_tp_seconds``)."""
    out: list[Collective] = []
    ga = s.gradient_accumulation_steps
    if with_data_parallel or s.lora_r or s.load_in_4bit:
        out += data_parallel(model, layout, s)
    tokens = s.micro_batch_size * s.sequence_len // layout.cp  # tokens per rank per micro-batch
    if layout.tp > 1:
        out += _TP.get(
            (model, layout.tp, tokens, ga, _TP_FIELDS(s)),
            lambda: tuple(_tensor_parallel(model, layout, s, tokens, ga)),
        )
        out += [
            Collective(kind, "tp", nbytes, n, what)
            for kind, nbytes, n, what in tiled_tp_extra(model, layout, s, tokens, ga)
        ]
    if layout.cp > 1:
        out += _CP.get(
            (model, layout.cp, layout.tp, tokens, ga, _CP_FIELDS(s)),
            lambda: tuple(_context_parallel(model, layout, s, tokens, ga)),
        )
    if model.is_moe:
        out += moe_cost.collectives(model, layout, s, tokens, ga, Collective)
    if s.lora_r:
        out = adapt_collectives(out, model, layout, s, Collective)
    if s.load_in_4bit:
        out = nf4_collectives(out, model, layout, s)
    return [c for c in out if c.count > 0]


# A rank's data-parallel, tensor-parallel and context-parallel collectives, memoised
# (``plan/memo.py``) on the settings each reads (``layout.COLLECTIVE_FIELDS``) with the model, the
# layout (data parallel) or its tp (tensor parallel) or cp and tp (context parallel), the
# micro-batch's tokens and ``grad_accum``: the search asks for the same ones under many options.
_DP_FIELDS, _TP_FIELDS, _CP_FIELDS = (attrgetter(*names) for names in COLLECTIVE_FIELDS.values())
_DP, _TP, _CP = Memo(), Memo(), Memo()


def data_parallel(model: ModelSpec, layout: ParallelDims, s: Settings) -> tuple[Collective, ...]:
    """FSDP's and DDP's collectives of one step (``_data_parallel``), memoised on the settings they
    read; ``collectives_for`` adapts them under LoRA and NF4."""
    return _DP.get((model, layout, _DP_FIELDS(s)), lambda: tuple(_data_parallel(model, layout, s)))


def _data_parallel(model: ModelSpec, layout: ParallelDims, s: Settings) -> list[Collective]:
    """FSDP2 per unit and micro-batch: all-gather in forward (+ again in backward if resharded;
    ``Settings.gathers_per_step``); reduce-scatter of gradients in fp32 on every micro-batch (only
    the last one with ``unsharded_grad_accumulation``) and the HSDP/DDP all-reduce over
    dp_replicate once per step (every micro-batch with ``sync_every_microbatch``): the calls of
    ``data_parallel_calls``, each ``calls_per_step`` times."""
    return [
        Collective(kind, dim, nbytes, calls_per_step(kind, count, reshards, s), what, "compute")
        for kind, dim, nbytes, what, count, reshards in data_parallel_calls(model, layout, s)
    ]


DataParallelCall = tuple
"""(kind, mesh dim, bytes per call, what, the unit's count, whether it reshards after forward): one
of a step's data-parallel collectives before its number of calls (``calls_per_step``)."""


def data_parallel_calls(model: ModelSpec, layout: ParallelDims, s: Settings) -> list[DataParallelCall]:
    """Per FSDP unit its all-gather and reduce-scatter (sharded over ``n`` > 1 ranks) and its
    replicas' all-reduce: what ``_data_parallel`` counts. Of ``s`` it reads only the bytes of an
    element (``mixed_precision``), not the step's accumulation, resharding or synchronisation: the
    search's bounds reuse it across them (``bounds.fsdp_traffic``)."""
    out = []
    compute_bytes, reduce_bytes = s.param_compute_bytes, s.reduce_bytes
    numels = unit_numels(model, layout.tp, layout.fsdp, layout)
    for unit, (count, reshards) in fsdp_units(model).items():
        local, shard = numels[unit]
        dim, n = ("efsdp", layout.efsdp) if unit == "experts" else ("dp_shard_cp", layout.fsdp)
        if n > 1:
            gather, scatter = f"FSDP all-gather params ({unit})", f"FSDP reduce-scatter grads ({unit})"
            out.append(("all_gather", dim, shard * compute_bytes, gather, count, reshards))
            out.append(("reduce_scatter", dim, shard * n * reduce_bytes, scatter, count, reshards))
        if layout.dp_replicate > 1:
            size = shard if n > 1 else local
            what = f"{'HSDP' if n > 1 else 'DDP'} all-reduce grads ({unit})"
            out.append(("all_reduce", "dp_replicate", size * reduce_bytes, what, count, reshards))
    return out


def calls_per_step(kind: str, count: int, reshards: bool, s: Settings) -> int:
    """Calls per step of a data-parallel collective of ``count`` units (``data_parallel_calls``)."""
    if kind == "all_gather":
        return s.gathers_per_step(reshards) * count
    if kind == "reduce_scatter":
        return count * s.reducing_microbatches
    return count * s.replica_reductions


def _tensor_parallel(model: ModelSpec, layout: ParallelDims, s: Settings, tokens: int, ga: int):
    """Per decoder layer two colwise→rowwise pairs (attention, MLP). With sequence parallel each
    pair is all-gather (in) + reduce-scatter (out) in forward and the mirror in backward; without,
    one all-reduce in forward (rowwise output) and one in backward (the block's input gradient). Recompute
    under checkpointing repeats the forward ones except the
    MLP output's reduction. Embedding (vocab-parallel) and LM head
    (colwise) add one each way; loss parallel adds 3 fp32 all-reduces per token (max, sum-exp,
    target logit), without it the logits are all-gathered. Norm weights replicated over tp on
    sharded inputs (sequence or heads) get their grads all-reduced. Block inputs saved as sequence
    shards are all-gathered again in backward (``plan/memory/sp_activations.py``)."""
    t, h, L, ab = layout.tp, model.hidden, model.layers, s.act_bytes
    embed, head = int(model.has_embedding), int(model.has_lm_head)  # a pipeline rank may lack them
    full = tokens * h * ab
    shard = full // t
    # Forward passes of the pairs. The recomputed forward under checkpointing (torch's
    # non-reentrant checkpoint, which stops recomputing once the last tensor saved for backward
    # is rebuilt) repeats both block inputs (all-gather under SP) but only the attention
    # output's reduction: the MLP's down_proj output feeds nothing that is saved.
    ck = 1 if recomputes_layers(s) else 0
    fwd_in = 2 * L * (1 + ck) + recompute_regathers_per_step(model, layout, s)  # + shards re-gathered
    fwd = 2 * L + L * ck
    bwd = 2 * L
    # Without sequence parallel the block input is one Replicate DTensor shared by q, k, v (gate,
    # up): their partial input gradients are summed, then all-reduced once per block (Megatron's
    # "f"); measured by tests/test_plan_vs_runtime.py.
    bwd_no_sp = bwd
    out = []
    if s.sequence_parallel:
        out += [
            Collective("all_gather", "tp", shard, (fwd_in + bwd) * ga, "TP/SP all-gather (layers)"),
            Collective("reduce_scatter", "tp", full, (fwd + bwd) * ga, "TP/SP reduce-scatter (layers)"),
            Collective("reduce_scatter", "tp", full, ga * embed, "TP embedding output (fwd)"),
            Collective("all_gather", "tp", shard, ga * embed, "TP embedding grad (bwd)"),
            Collective("all_gather", "tp", shard, ga * head, "TP LM-head input (fwd)"),
            Collective("reduce_scatter", "tp", full, ga * head, "TP LM-head input grad (bwd)"),
        ]
    else:
        out += [
            Collective("all_reduce", "tp", full, fwd * ga, "TP all-reduce rowwise outputs (fwd)"),
            Collective("all_reduce", "tp", full, bwd_no_sp * ga, "TP all-reduce block input grads (bwd)"),
            Collective("all_reduce", "tp", full, ga * embed, "TP embedding output (fwd)"),
            Collective("all_reduce", "tp", full, ga * head, "TP LM-head input grad (bwd)"),
        ]
    if s.loss_parallel:
        out.append(Collective("all_reduce", "tp", tokens * 4, 3 * ga * head, "TP loss-parallel statistics"))
    else:
        vocab_local = -(-model.vocab // t)
        out.append(
            Collective(
                "all_gather", "tp", tokens * vocab_local * ab, ga * head, "TP LM-head logits gathered (fwd)"
            )
        )
    for p in model.param_specs():
        partial = p.tp_dim is None and (s.sequence_parallel or "q_norm" in p.name or "k_norm" in p.name)
        if partial:
            out.append(
                Collective(
                    "all_reduce",
                    "tp",
                    p.numel * s.param_compute_bytes,
                    p.count * ga,
                    f"TP replicated-grad all-reduce ({p.name})",
                )
            )
    return out


def _context_parallel(model: ModelSpec, layout: ParallelDims, s: Settings, tokens: int, ga: int):
    """Ring attention per layer (``parallel/cp/parallel_attention.py``): K and V stacked in one buffer go
    around the ring, cp−1 hops in forward (and in the recomputed forward), cp−1 hops in backward,
    plus cp hops of the fp32 dK/dV accumulators (the last one returning them home).
    All-gather strategy: the stacked local K/V all-gathered once per forward (kept for backward),
    the fp32 dK/dV of the whole sequence reduce-scattered once in backward.
    All-to-all (Ulysses, ``parallel/cp/ulysses.py``): see ``_ulysses``."""
    c, L = layout.cp, model.layers
    kv_elems = 2 * tokens * model.kv_heads * model.head_dim // layout.tp
    fwd = (c - 1) * (2 if recomputes_layers(s) else 1)
    if s.cp_comm_strategy == "ulysses":
        return _ulysses(model, layout, s, tokens, ga)
    if s.cp_comm_strategy == "allgather":
        passes = 2 if recomputes_layers(s) else 1
        return [
            Collective("all_gather", "cp", kv_elems * s.act_bytes, passes * L * ga, "CP all-gather K/V"),
            Collective("reduce_scatter", "cp", c * kv_elems * 4, L * ga, "CP reduce-scatter dK/dV (fp32)"),
        ]
    if s.cp_comm_strategy != "ring":
        raise ValueError(f"cp_strategy={s.cp_comm_strategy!r}: use 'ring', 'allgather' or 'ulysses'")
    return [
        Collective(
            "send_recv", "cp", kv_elems * s.act_bytes, (fwd + (c - 1)) * L * ga, "CP ring K/V", "attention"
        ),
        Collective("send_recv", "cp", kv_elems * 4, c * L * ga, "CP ring dK/dV (fp32)", "attention"),
    ]


def _ulysses(model: ModelSpec, layout: ParallelDims, s: Settings, tokens: int, ga: int):
    """Per layer and forward (repeated by the recompute under checkpointing): one all-to-all of
    Q, K, V packed together (K/V heads per tp rank raised to cp when fewer: replicated) and one of
    the attention output, plus an all-gather of the int32 position ids (document masks); per
    backward the two all-to-alls mirrored (gradients in the activation dtype). Bytes: the input
    of one rank, ``tokens`` = its sequence shard."""
    c, L, t, d = layout.cp, model.layers, layout.tp, model.head_dim
    heads, kv = model.heads // t, max(model.kv_heads // t, c)
    passes = 2 if recomputes_layers(s) else 1
    qkv = tokens * (heads + 2 * kv) * d * s.act_bytes
    out = tokens * heads * d * s.act_bytes
    return [
        Collective("all_to_all", "cp", qkv, (passes + 1) * L * ga, "CP all-to-all Q/K/V (dQ/dK/dV)"),
        Collective("all_to_all", "cp", out, (passes + 1) * L * ga, "CP all-to-all output (its grad)"),
        Collective("all_gather", "cp", tokens * 4, passes * L * ga, "CP position ids (int32)"),
    ]


def scalar_collectives(
    model: ModelSpec, layout: ParallelDims, mixed_precision: str = "bf16"
) -> list[Collective]:
    """The training step's scalar collectives per optimizer step (``engine.step.train_step``, which
    ``train``, ``verify`` and ``train_under_layout`` run):

    * the global count of loss tokens: one int64 all-reduce over ``dp`` (if dp > 1);
    * the step's loss: one fp32 all-reduce over ``dp_cp`` (if dp·cp > 1; ``reduce_step_loss``);
    * under pipeline parallel the last stage's step loss, one fp32 all-reduce over ``pp`` (the
      tied-embedding gradient sum between the first and last stage is not listed);
    * the gradient norm (``techniques/grad_norm.py``): each rank's sum of its shards' squares, one
      fp32 all-reduce over the whole world (every stage, every mesh, the experts' too); a gradient
      DTensor left Partial (a replicated weight fed sharded activations on a mesh without FSDP,
      e.g. some families' norm weights under TP) is summed first, one all-reduce each (not listed).
    The routers' load-balancing loss of an MoE model adds one all-reduce of its statistics
    (2·E + 1 fp32) per micro-batch when the model adds that loss (not listed here). ``model`` and
    ``mixed_precision`` change none of these (kept for the callers' one signature).
    """
    out = []
    if layout.dp > 1:
        out.append(Collective("all_reduce", "dp", 8, 1, "global token count (int64)"))
    if layout.dp * layout.cp > 1:
        out.append(Collective("all_reduce", "dp_cp", 4, 1, "step loss (fp32)"))
    if layout.pp > 1:  # the last stage's loss to every stage
        out.append(Collective("all_reduce", "pp", 4, 1, "step loss across stages (fp32)"))
    if layout.world > 1:
        out.append(Collective("all_reduce", "world", 4, 1, "gradient norm (fp32 sum of squares)"))
    return out


def aggregate(collectives: list[Collective]) -> dict[tuple[str, str, int], int]:
    """(kind, mesh_dim, bytes) -> total calls per step: the form to compare with runtime counts."""
    out: dict[tuple[str, str, int], int] = defaultdict(int)
    for c in collectives:
        out[(c.kind, c.mesh_dim, c.bytes)] += c.count
    return dict(out)
