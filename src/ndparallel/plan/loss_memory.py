"""The chunked loss's memory in the planner (``techniques/chunked_ce.py``): one chunk's logits,
the LM-head weight-gradient accumulator and one vocabulary slice of a chunk's product, and the
chunk size rule. Used by ``plan/memory.py``'s logits term (its docstring says what is counted)."""

from __future__ import annotations

from ndparallel.plan.layout import Settings


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
