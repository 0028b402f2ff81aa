"""Context parallelism as a strategy: validation, plugging the CP attention into transformers, and
in-place sequence sharding of the batch (``context_parallel_buffers``).

How the attention finds its cp group: ``apply_context_parallel`` registers, in transformers'
``AttentionInterface`` (and ``AttentionMaskInterface``), a function under a name unique to the
(cp group, strategy, load balance, kernel) — e.g. ``ndparallel_cp_ring_lb_auto_pg3`` — whose
closure holds the group, and sets the model's attention implementation to that name. So there is
no global state of ours and no attribute on the modules; two models on two meshes get two names.
The registered mask function returns no mask (the attention derives its causal and document masks
from ``position_ids``) and raises on a padding mask, which transformers would otherwise drop
silently for custom names. The hook's checks and the registration are those of the document
attention without CP (``parallel/document_attention.py``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch
import torch.distributed as dist

from ndparallel.layout.mesh import process_group
from ndparallel.parallel.cp.attention_blocks import DocCache
from ndparallel.parallel.cp.parallel_attention import STRATEGIES, context_parallel_attention
from ndparallel.parallel.cp.sharding import cp_num_chunks, shard_for_cp
from ndparallel.parallel.cp.ulysses import ulysses_head_error
from ndparallel.parallel.document_attention import (
    ATTENTION_LAYER_TYPES,
    check_call,
    layer_features,
    register_attention,
)
from ndparallel.parallel.options import CPOptions
from ndparallel.parallel.positions import PositionRecorder


def validate_context_parallel(
    config,
    cp_size: int,
    seq_len: int | None = None,
    tp_size: int = 1,
    load_balance: bool = True,
    strategy: str = "ring",
) -> None:
    """Raise ValueError (naming the field and the fix) if ``config`` cannot run with this CP layout
    (a multimodal config: its text model's fields)."""
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    if cp_size < 1:
        raise ValueError(f"context_parallel_size={cp_size} must be >= 1")
    if strategy not in STRATEGIES:
        raise ValueError(f"cp_comm_strategy={strategy!r} is not one of {', '.join(STRATEGIES)}")
    n = cp_num_chunks(cp_size, load_balance)
    if seq_len is not None and seq_len % n:
        up = seq_len + (-seq_len) % n
        raise ValueError(
            f"sequence_len={seq_len} is not a multiple of {'2·' if load_balance else ''}"
            f"context_parallel_size = {n}: set sequence_len to a multiple of {n} (e.g. {up}) or pad "
            "batches with ndparallel.parallel.cp.sharding.pad_for_cp"
        )
    heads = getattr(config, "num_attention_heads", None)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    if tp_size > 1 and heads is not None:
        for field, value in (("num_attention_heads", heads), ("num_key_value_heads", kv_heads)):
            if value % tp_size:
                raise ValueError(
                    f"{field}={value} is not divisible by tensor_parallel_size={tp_size}: with TP×CP "
                    f"each TP rank runs CP attention on {field}/tp heads; choose a "
                    f"tensor_parallel_size that divides {value}"
                )
    if strategy == "ulysses" and cp_size > 1 and heads is not None:
        error = ulysses_head_error(heads // tp_size, kv_heads // tp_size, cp_size)
        if error:
            raise ValueError(
                f"cp_comm_strategy='ulysses' splits heads over cp ranks, but {error} "
                f"(num_attention_heads={heads}, num_key_value_heads={kv_heads}, "
                f"tensor_parallel_size={tp_size}): use cp_comm_strategy 'ring' or 'allgather', or a "
                "context_parallel_size that divides the query heads per TP rank and divides or is "
                "divided by the key/value heads per TP rank"
            )
    if cp_size > 1 and getattr(config, "attention_dropout", 0.0):
        raise ValueError(
            f"attention_dropout={config.attention_dropout} is not supported with context parallelism; "
            "set config.attention_dropout = 0.0"
        )
    floor = getattr(config, "floor_scale", None)
    if (
        cp_size > 1
        and getattr(config, "attn_temperature_tuning", False)
        and seq_len
        and floor
        and seq_len >= floor
    ):
        raise ValueError(temperature_tuning_message(seq_len, floor))
    kinds = sorted({str(t) for t in getattr(config, "layer_types", None) or ()} - set(ATTENTION_LAYER_TYPES))
    if cp_size > 1 and kinds:
        raise ValueError(
            f"layer_types {kinds} are not attention layers: context parallelism splits the sequence "
            "and only ndparallel's attention exchanges tokens between ranks, so such a layer would "
            "see its shard alone; train this model without context_parallel_size"
        )


def attention_name(
    cp_mesh, options: CPOptions = CPOptions(), kernel: str = "auto", owner: object = None
) -> str:
    """The ``AttentionInterface`` name ``apply_context_parallel`` uses for this group and options
    (and ``owner``: each model gets its own registration, whose closure records its positions)."""
    group = process_group(cp_mesh)
    lb = "lb" if options.load_balance else "contig"
    suffix = "" if owner is None else f"_m{id(owner):x}"
    return f"ndparallel_cp_{options.comm_strategy}_{lb}_{kernel}_pg{group.group_name}{suffix}"


def _check_temperature_tuning(module, seq_len: int) -> None:
    """Llama 4's NoPE layers scale queries by a function of ``arange(local length)``: under CP the
    local index, not the global one — equal only while the sequence is shorter than
    ``floor_scale`` (every token then gets scale 1)."""
    if getattr(module, "attn_temperature_tuning", False) and not getattr(module, "use_rope", True):
        floor = getattr(module, "floor_scale", None)
        if floor is not None and seq_len >= floor:
            raise ValueError(temperature_tuning_message(seq_len, floor))


def temperature_tuning_message(seq_len: int, floor_scale: int) -> str:
    return (
        f"sequence length {seq_len} >= floor_scale={floor_scale}: Llama 4's attention temperature "
        "tuning (NoPE layers) numbers the tokens of a context-parallel shard from 0, so it would "
        f"differ from one device; use sequence_len < {floor_scale} with context parallelism, or "
        "train without context_parallel_size"
    )


def make_attention_fn(
    cp_mesh, options: CPOptions = CPOptions(), kernel: str = "auto", recorder: PositionRecorder | None = None
):
    """HF attention function ``fn(module, q, k, v, attention_mask, scaling=None, dropout=0.0, **kw)
    -> (out [B, S, H, Dv], None)`` running CP attention on the group of ``cp_mesh``; documents
    (``position_ids`` restarting at 0: passed by the model in ``kw``, else the decoder's, from
    ``recorder``) are never attended across; the layer's sliding window, attention chunk and soft
    cap (``layer_features``) are honoured."""
    group = process_group(cp_mesh)
    strategy, load_balance = options.comm_strategy, options.load_balance
    cache = DocCache()  # the document layout of the current batch, shared by the layers
    recorder = recorder or PositionRecorder()

    def cp_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        check_call(module, attention_mask, dropout, kwargs)
        _check_temperature_tuning(module, query.shape[2] * dist.get_world_size(group))
        window, chunk, softcap = layer_features(module, kwargs)
        out = context_parallel_attention(
            query,
            key,
            value,
            group,
            strategy=strategy,
            load_balance=load_balance,
            scale=scaling,
            kernel=kernel,
            position_ids=recorder.positions(kwargs),
            cache=cache,
            window=window,
            chunk=chunk,
            softcap=softcap,
        )
        return out.transpose(1, 2).contiguous(), None

    return cp_attention_forward


def apply_context_parallel(model, cp_mesh, options: CPOptions = CPOptions(), kernel: str = "auto"):
    """Make ``model``'s attention context-parallel over ``cp_mesh`` (1-D DeviceMesh or ProcessGroup).

    The model must then get sharded inputs (``context_parallel_buffers``) with explicit global
    ``position_ids`` and no padding mask. A cp group of size 1 leaves the model unchanged.
    """
    group = process_group(cp_mesh)
    if dist.get_world_size(group) == 1:
        return model
    validate_context_parallel(
        model.config,
        dist.get_world_size(group),
        load_balance=options.load_balance,
        tp_size=_tp_degree(model),
        strategy=options.comm_strategy,
    )
    recorder = PositionRecorder().attach(model)
    register_attention(
        model,
        attention_name(group, options, kernel, owner=recorder),
        make_attention_fn(group, options, kernel, recorder),
    )
    return model


def _tp_degree(model) -> int:
    """The tensor-parallel degree of ``model``'s attention projections (1 if not TP)."""
    for module in model.modules():
        mesh = getattr(getattr(module, "weight", None), "device_mesh", None)
        if mesh is not None and "tp" in (mesh.mesh_dim_names or ()):
            return mesh.size(mesh.mesh_dim_names.index("tp"))
    return 1


@contextlib.contextmanager
def context_parallel_buffers(
    cp_mesh,
    buffers: Sequence[torch.Tensor],
    buffer_seq_dims: Sequence[int],
    no_restore_buffers: Sequence[torch.Tensor] | set | None = None,
    load_balance: bool = True,
) -> Iterator[list[torch.Tensor]]:
    """Shard ``buffers`` IN PLACE along ``buffer_seq_dims`` for the block; restore them after.

    Each tensor is re-pointed (``Tensor.set_``) at this rank's shard, so existing references (the
    batch dict) see the local sequence; the full data is kept by an alias and put back on exit,
    except for tensors in ``no_restore_buffers`` (by identity), which stay sharded. A tensor listed
    twice is sharded once. Yields the (same) buffer objects. Lengths must be multiples of 2·cp.
    """
    if len(buffers) != len(buffer_seq_dims):
        raise ValueError(f"{len(buffers)} buffers but {len(buffer_seq_dims)} buffer_seq_dims")
    group = process_group(cp_mesh)
    cp_size, cp_rank = dist.get_world_size(group), dist.get_rank(group)
    keep = {id(t) for t in (no_restore_buffers or ())}
    n = cp_num_chunks(cp_size, load_balance)
    for i, (buf, dim) in enumerate(zip(buffers, buffer_seq_dims)):
        if buf.shape[dim] % n:
            raise ValueError(
                f"buffers[{i}] has length {buf.shape[dim]} on dim {dim}, not a multiple of "
                f"{'2·cp' if load_balance else 'cp'} = {n}; pad the batch with pad_for_cp first"
            )
    saved: list[tuple[torch.Tensor, torch.Tensor]] = []
    seen: set[int] = set()
    try:
        with torch.no_grad():
            for buf, dim in zip(buffers, buffer_seq_dims):
                if id(buf) in seen:
                    continue
                seen.add(id(buf))
                alias = buf.new_empty(0).set_(
                    buf.untyped_storage(), buf.storage_offset(), buf.shape, buf.stride()
                )
                shard = shard_for_cp(buf, dim, cp_rank, cp_size, load_balance)
                buf.set_(shard)
                if id(buf) not in keep:
                    saved.append((buf, alias))
        yield list(buffers)
    finally:
        with torch.no_grad():
            for buf, alias in saved:
                buf.set_(alias)
