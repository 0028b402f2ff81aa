"""Context parallelism as a strategy: validation, plugging the CP attention into transformers, and
in-place sequence sharding of the batch (``context_parallel_buffers``).

How the attention finds its cp group: ``apply_context_parallel`` registers, in transformers'
``AttentionInterface`` (and ``AttentionMaskInterface``), a function under a name unique to the
(cp group, strategy, load balance, kernel) — e.g. ``ndparallel_cp_ring_lb_auto_pg3`` — whose
closure holds the group, and sets the model's attention implementation to that name. So there is
no global state of ours and no attribute on the modules; two models on two meshes get two names.
The registered mask function returns no mask (the attention is causal by construction) and
raises on a padding mask, which transformers would otherwise drop silently for custom names.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Sequence

import torch
import torch.distributed as dist

from ndparallel.layout.mesh import process_group
from ndparallel.parallel.cp_attention import context_parallel_attention
from ndparallel.parallel.cp_sharding import cp_num_chunks, shard_for_cp
from ndparallel.parallel.options import CPOptions


def validate_context_parallel(
    config, cp_size: int, seq_len: int | None = None, tp_size: int = 1, load_balance: bool = True
) -> None:
    """Raise ValueError (naming the field and the fix) if ``config`` cannot run with this CP layout."""
    if cp_size < 1:
        raise ValueError(f"context_parallel_size={cp_size} must be >= 1")
    n = cp_num_chunks(cp_size, load_balance)
    if seq_len is not None and seq_len % n:
        up = seq_len + (-seq_len) % n
        raise ValueError(
            f"sequence_len={seq_len} is not a multiple of {'2·' if load_balance else ''}"
            f"context_parallel_size = {n}: set sequence_len to a multiple of {n} (e.g. {up}) or pad "
            "batches with ndparallel.parallel.cp_sharding.pad_for_cp"
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
    if cp_size > 1 and getattr(config, "attention_dropout", 0.0):
        raise ValueError(
            f"attention_dropout={config.attention_dropout} is not supported with context parallelism; "
            "set config.attention_dropout = 0.0"
        )
    if cp_size > 1 and _uses_sliding_window(config):
        raise ValueError(
            "sliding-window attention (config.sliding_window / layer_types) is not supported with "
            "context parallelism; disable it (sliding_window=None / use_sliding_window=False)"
        )


def _uses_sliding_window(config) -> bool:
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return any("sliding" in str(t) for t in layer_types)
    return getattr(config, "sliding_window", None) is not None and getattr(config, "use_sliding_window", True)


def attention_name(cp_mesh, options: CPOptions = CPOptions(), kernel: str = "auto") -> str:
    """The ``AttentionInterface`` name ``apply_context_parallel`` uses for this group and options."""
    group = process_group(cp_mesh)
    lb = "lb" if options.load_balance else "contig"
    return f"ndparallel_cp_{options.comm_strategy}_{lb}_{kernel}_pg{group.group_name}"


def make_attention_fn(cp_mesh, options: CPOptions = CPOptions(), kernel: str = "auto"):
    """HF attention function ``fn(module, q, k, v, attention_mask, scaling=None, dropout=0.0, **kw)
    -> (out [B, S, H, D], None)`` running CP attention on the group of ``cp_mesh``."""
    group = process_group(cp_mesh)
    strategy, load_balance = options.comm_strategy, options.load_balance

    def cp_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        if attention_mask is not None:
            raise ValueError(
                "context-parallel attention takes no attention_mask (packed causal LM only): drop "
                "the padding mask and pad with ignored labels instead (pad_for_cp)"
            )
        if dropout:
            raise ValueError("attention dropout is not supported with context parallelism")
        for unsupported in ("sliding_window", "softcap", "s_aux"):
            if kwargs.get(unsupported) is not None:
                raise ValueError(f"{unsupported} is not supported by context-parallel attention")
        if not getattr(module, "is_causal", True):
            raise ValueError("context-parallel attention is causal only; this module is not causal")
        out = context_parallel_attention(
            query, key, value, group, strategy=strategy, load_balance=load_balance,
            scale=scaling, kernel=kernel,
        )
        return out.transpose(1, 2).contiguous(), None

    return cp_attention_forward


def _cp_mask(*, attention_mask=None, **_):
    if attention_mask is not None and not bool(attention_mask.all()):
        raise ValueError(
            "context parallelism does not support padding masks: pack sequences (position_ids carry "
            "the global positions) and pad with ignored labels (pad_for_cp) instead"
        )
    return None


def apply_context_parallel(model, cp_mesh, options: CPOptions = CPOptions(), kernel: str = "auto"):
    """Make ``model``'s attention context-parallel over ``cp_mesh`` (1-D DeviceMesh or ProcessGroup).

    The model must then get sharded inputs (``context_parallel_buffers``) with explicit global
    ``position_ids`` and no padding mask. A cp group of size 1 leaves the model unchanged.
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    group = process_group(cp_mesh)
    if dist.get_world_size(group) == 1:
        return model
    validate_context_parallel(model.config, dist.get_world_size(group), load_balance=options.load_balance)
    name = attention_name(group, options, kernel)
    AttentionInterface.register(name, make_attention_fn(group, options, kernel))
    AttentionMaskInterface.register(name, _cp_mask)
    model.set_attn_implementation(name)
    if model.config._attn_implementation != name:
        raise RuntimeError(
            f"{type(model).__name__} did not accept attention implementation {name!r}; context "
            "parallelism needs a model using transformers' AttentionInterface"
        )
    return model


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
                alias = buf.new_empty(0).set_(buf.untyped_storage(), buf.storage_offset(), buf.shape, buf.stride())
                shard = shard_for_cp(buf, dim, cp_rank, cp_size, load_balance)
                buf.set_(shard)
                if id(buf) not in keep:
                    saved.append((buf, alias))
        yield list(buffers)
    finally:
        with torch.no_grad():
            for buf, alias in saved:
                buf.set_(alias)
