"""The loss's memory at the loss backward: the full logits, the vocabulary-parallel loss's, or the
chunked loss's (``techniques/chunked_ce.py``: one chunk's logits, the LM-head weight-gradient
accumulator and one vocabulary slice of a chunk's product, and the chunk size rule)."""

from __future__ import annotations

from ndparallel.layout.dims import ParallelDims
from ndparallel.plan.memory.long_context import (
    norm_saved_per_row,
)
from ndparallel.plan.models import ModelSpec
from ndparallel.plan.settings import Settings


def logits_bytes(model: ModelSpec, layout: ParallelDims, s: Settings, tokens: float) -> float:
    """Logits and loss tensors at the loss backward's peak, plus the final norm and LM-head input.

    Per logit: the logits (e), the fp32 log-softmax kept for backward, and in its backward two
    fp32 gradients (nll, log-softmax) = e + 12 (measured on the H200: 14 B per logit in bf16);
    loss parallel's fused nll + log-softmax backward (torch.distributed.tensor.parallel.loss)
    holds zeros_like(x), exp(x) and their sum at once = e + 16.
    The chunked loss (``techniques/chunked_ce.py``, the runtime's default) computes its gradients
    during the forward: one chunk's fp32 logits and, under mixed precision, their compute-dtype
    copy (``chunk_logit_bytes``: 4 + e per logit, 4 in fp32),
    the hidden-state gradient (e per hidden value) and an fp32 LM-head weight-gradient accumulator
    with, under mixed precision, one vocabulary slice of a chunk's contribution before it is added
    (``chunk_head_grad_bytes``: 4 per weight of the local vocabulary slice, + (e + 4) per chunk
    logit) — or, if larger, its backward: the accumulator and the returned gradient (4 + e per
    weight);
    never the full logits."""
    t, e = layout.tp, s.act_bytes
    t_sp = t if s.sequence_parallel else 1
    v_local = -(-model.vocab // t)
    if s.chunked_loss:
        chunk = chunk_tokens(s, v_local, tokens)
        forward = chunk * v_local * chunk_logit_bytes(e) + chunk_head_grad_bytes(
            e, chunk, v_local, model.hidden
        )
        # its backward returns the weight gradient in the compute dtype beside the fp32 accumulator
        backward = v_local * model.hidden * (4 + (e if e != 4 else 0))
        out = max(forward, backward) + tokens * model.hidden * e
    elif s.loss_parallel and t > 1:
        out = tokens * v_local * (e + 16)
    else:
        out = tokens * model.vocab * (e + 12)
    return out + tokens * (norm_saved_per_row(model.hidden, s) / t_sp + e * model.hidden)


def chunk_logit_bytes(e: int) -> int:
    """Bytes per logit of one chunk of the chunked loss: the fp32 logits, plus their compute-dtype
    copy (the matmul's output, later the gradient cast back) when that is not fp32 itself — in fp32
    ``.float()`` and ``.to(weight.dtype)`` return the same tensor (measured 2026-12-06: the
    planner's fp32 rows were one chunk of fp32 logits over, +7.5 % at FSDP 64, +17.9 % with a 64k
    vocabulary at hidden 256, ``bench/simulate_heldout.py``)."""
    return 4 + (e if e != 4 else 0)


def chunk_head_grad_bytes(e: int, chunk: int, vocab_local: int, hidden: int) -> float:
    """Bytes of the chunked loss's LM-head weight gradient while it accumulates: the fp32
    accumulator (4 per weight of the local vocabulary slice) and, under mixed precision, one
    vocabulary slice of a chunk's product ``g.t() @ h`` in the compute dtype with its fp32 copy
    (``techniques/chunked_ce.py: weight_grad_rows`` rows of ``hidden``: ``chunk × vocab_local``
    elements, e + 4 bytes each); in fp32 ``addmm_`` accumulates in place. Before 2026-12-06 the
    product was a whole head-sized matrix (e + 4 bytes per head weight: 3 GB for Llama-3.1-8B at
    tp 1); measured on CPU in ``tests/test_plan_chunked_loss.py``."""
    out = 4.0 * vocab_local * hidden
    if e != 4:
        rows = max(1, min(vocab_local, chunk * vocab_local // max(1, hidden)))
        out += rows * hidden * (e + 4)
    return out


def chunk_tokens(s: Settings, vocab_local: int, tokens: float) -> int:
    """Tokens per chunk of the chunked loss: ``s.loss_chunk_tokens``, else the runtime's rule (the
    largest power of two whose fp32 logits fit 256 MiB, ``parallel.chunked_ce``)."""
    if s.loss_chunk_tokens:
        return int(min(tokens, s.loss_chunk_tokens))
    fit = max(1, (256 * 2**20) // (4 * max(1, vocab_local)))
    return int(min(max(1, tokens), 1 << (fit.bit_length() - 1)))
