"""Document-masked causal attention on one device, shared by tensor and context parallelism.

Packed rows (``position_ids`` restarting at 0 where a document starts) are attended document by
document with O(S) memory: the block attention of ``attention_blocks`` / ``attention_kernels``, no
B×S×S mask. ``document_causal_attention`` is the op; ``apply_document_attention`` plugs it into a
model through transformers' ``AttentionInterface`` (TP's sequence parallel uses it, and scripts
training packed rows without CP). The hook's checks (``check_call``, ``layer_features``) and the
registration (``register_attention``) are shared with CP's attention (``cp/context.py``), which
runs the same blocks across a cp group (``cp/parallel_attention.py``).
"""

from __future__ import annotations

import math
from typing import Literal

import torch

from ndparallel.parallel.cp.attention_blocks import DocCache, DocLayout, document_starts, local_attention
from ndparallel.parallel.cp.attention_kernels import BlockKernel, resolve_kernel
from ndparallel.parallel.positions import PositionRecorder

Kernel = Literal["auto", "flash", "math"]

ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention")
"""``config.layer_types`` ndparallel's attention computes: causal, sliding-window (the layer's
``sliding_window``) and chunked (Llama 4's ``attention_chunk_size``)."""


def check_call(module, attention_mask, dropout, kwargs) -> None:
    if attention_mask is not None:
        raise ValueError(
            "context-parallel / document attention takes no attention_mask (packed causal LM only): "
            "drop the padding mask and pad with ignored labels instead (pad_for_cp)"
        )
    if dropout:
        raise ValueError("attention dropout is not supported by context-parallel / document attention")
    if kwargs.get("s_aux") is not None:
        raise ValueError("attention sinks (s_aux) are not supported by context-parallel / document attention")
    if not getattr(module, "is_causal", True):
        raise ValueError("context-parallel / document attention is causal only; this module is not causal")


def layer_features(module, kwargs) -> tuple[int | None, int | None, float | None]:
    """(sliding window, attention chunk, soft cap) of the layer calling the attention: the
    ``sliding_window`` / ``softcap`` the model passes (what transformers' flash-attention path
    uses), else the layer's ``config.layer_types`` entry."""
    config = getattr(module, "config", None)
    types, idx = getattr(config, "layer_types", None), getattr(module, "layer_idx", None)
    kind = types[idx] if types is not None and isinstance(idx, int) and idx < len(types) else None
    if kind is not None and kind not in ATTENTION_LAYER_TYPES:
        raise ValueError(
            f"layer {idx} is a {kind!r} layer: ndparallel's attention computes "
            f"{', '.join(ATTENTION_LAYER_TYPES)} layers only"
        )
    window = kwargs.get("sliding_window")
    if window is None and kind == "sliding_attention":
        window = getattr(config, "sliding_window", None)
    chunk = getattr(config, "attention_chunk_size", None) if kind == "chunked_attention" else None
    return window, chunk, kwargs.get("softcap")


def _no_padding_mask(*, attention_mask=None, **_):
    if attention_mask is not None and not bool(attention_mask.all()):
        raise ValueError(
            "context parallelism / document attention does not support padding masks: pack sequences "
            "(position_ids carry the global positions) and pad with ignored labels (pad_for_cp) instead"
        )
    return None


def register_attention(model, name: str, fn) -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(name, fn)
    AttentionMaskInterface.register(name, _no_padding_mask)
    model.set_attn_implementation(name)
    if model.config._attn_implementation != name:
        raise ValueError(
            f"{type(model).__name__} does not call attention through transformers' AttentionInterface, "
            "through which ndparallel's context-parallel / document attention replaces it: train this "
            "model without context_parallel_size (and without sequence_parallel)"
        )


def apply_document_attention(model, kernel: str = "auto"):
    """Without CP: switch ``model`` to ndparallel's document-masked causal attention (packed rows:
    ``position_ids`` restarting at 0) with O(S) memory and the flash kernel on CUDA bf16/fp16.
    transformers' own sdpa/eager handle packed rows too, but build a B×S×S mask; its
    flash_attention_2 (if installed) uses varlen kernels. Works under TP (each rank its heads)."""
    cache = DocCache()
    recorder = PositionRecorder().attach(model)

    def document_attention_forward(
        module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs
    ):
        check_call(module, attention_mask, dropout, kwargs)
        window, chunk, softcap = layer_features(module, kwargs)
        out = document_causal_attention(
            query, key, value, recorder.positions(kwargs), scaling, kernel, cache, window, chunk, softcap
        )
        return out.transpose(1, 2).contiguous(), None

    register_attention(model, f"ndparallel_documents_{kernel}_m{id(recorder):x}", document_attention_forward)
    return model


def check_shapes(query, key, value) -> None:
    if query.dim() != 4 or key.shape[:-1] != value.shape[:-1] or key.shape[:1] != query.shape[:1]:
        raise ValueError(
            f"expected q [B,H,S,D], k [B,Hk,S,D], v [B,Hk,S,Dv]; got {tuple(query.shape)}, "
            f"{tuple(key.shape)}, {tuple(value.shape)}"
        )
    if query.shape[1] % key.shape[1]:
        raise ValueError(f"num heads {query.shape[1]} is not a multiple of kv heads {key.shape[1]}")
    if query.shape[2] != key.shape[2] or query.shape[-1] != key.shape[-1]:
        raise ValueError("query and key must have the same sequence length and head dim")


def same_head_dims(query, key, value):
    """MLA-style attention (value head dim ≠ query/key head dim, DeepSeek-V3): zero-pad the
    smaller side so every kernel and the ring's stacked K/V see one head dim. Exact: zero value
    columns give zero output columns (sliced off), zero q/k columns add nothing to the scores.
    Costs the padding (e.g. V 128 -> 192: +50 % of V)."""
    dq, dv = query.shape[-1], value.shape[-1]
    if dv < dq:
        value = torch.nn.functional.pad(value, (0, dq - dv))
    elif dq < dv:
        query, key = (torch.nn.functional.pad(t, (0, dv - dq)) for t in (query, key))
    return query, key, value, dv


def make_block_kernel(
    kernel: str, query: torch.Tensor, scale: float | None, softcap: float | None
) -> BlockKernel:
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else float(scale)
    return BlockKernel(resolve_kernel(kernel, query, softcap), scale, softcap)


def document_causal_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    position_ids: torch.Tensor | None = None,
    scale: float | None = None,
    kernel: Kernel = "auto",
    cache=None,
    window: int | None = None,
    chunk: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Causal attention on one device that never crosses a document start (``position_ids``
    restarting at 0; None = plain causal). q [B, H, S, D], k [B, Hk, S, D], v [B, Hk, S, Dv].
    ``window``: sliding window (query i sees keys > i − window); ``chunk``: chunked attention
    (restarts every ``chunk`` tokens); ``softcap``: soft-capped scores. Memory O(S): no S×S mask;
    each document is one causal block. ``cache``: a ``DocCache`` shared by the layers of one
    forward (one host copy of the positions per forward)."""
    check_shapes(query, key, value)
    b, s = query.shape[0], query.shape[2]
    block_kernel = make_block_kernel(kernel, query, scale, softcap)
    query, key, value, dv = same_head_dims(query, key, value)

    def build():
        starts = document_starts(position_ids, torch.arange(s), b, chunk)
        return DocLayout(starts, (0,), s, b, query.device, window)

    extra = (b, s, 1, 0, window, chunk)
    docs = cache.get(position_ids, extra, build) if cache is not None else build()
    return local_attention(query, key, value, block_kernel, docs)[..., :dv]
