"""Linear + cross-entropy in chunks of tokens: the causal-LM loss without the full logits.

``chunked_linear_cross_entropy(hidden, weight, labels, n)`` equals
``cross_entropy(hidden @ weight.T, labels, reduction="sum") / n`` but holds the logits of at most
``chunk_tokens`` tokens at a time. The gradients are computed chunk by chunk *in the forward pass*
(the loss backward comes right after it, so nothing is recomputed: the head costs the same three
matmuls as the plain path) and scaled by the incoming gradient in backward.

Under tensor parallelism the weight is the vocab-sharded ``Shard(0)`` DTensor of the LM head: each
tp rank computes its slice of the vocabulary and the per-token max, sum of exponentials and target
logit are all-reduced over tp (Megatron's vocab-parallel cross-entropy); the hidden-state gradient
leaves as a ``Partial`` DTensor, so DTensor sums it over tp (all-reduce, or reduce-scatter under
sequence parallel). Why not torch's ``F.linear_cross_entropy`` (2.13): it knows no vocab sharding
and does not exist in torch 2.11, which this project supports.

Memory per rank: ``chunk_tokens × vocab/tp`` fp32 logits (one buffer, updated in place) and their
compute-dtype copy, the hidden-state gradient, and an fp32 weight-gradient accumulator
(vocab/tp × hidden); under mixed precision a chunk's weight-gradient product is made one
vocabulary slice at a time (``weight_grad_rows``: ``chunk × vocab/tp`` elements and their fp32
copy), never a whole head-sized matrix.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

IGNORE_INDEX = -100
CHUNK_LOGIT_BYTES = 256 * 2**20
"""Default chunk: as many tokens as fit ``chunk × vocab_local`` fp32 logits in 256 MiB."""


def default_chunk_tokens(vocab_local: int, tokens: int) -> int:
    """A power of two of tokens whose fp32 logits fit ``CHUNK_LOGIT_BYTES`` (at least 1)."""
    fit = max(1, CHUNK_LOGIT_BYTES // (4 * max(1, vocab_local)))
    return min(max(1, tokens), 1 << (fit.bit_length() - 1))


def weight_grad_rows(chunk: int, vocab_local: int, hidden: int) -> int:
    """Vocabulary rows per slice of a chunk's weight-gradient product ``g.t() @ h`` under mixed
    precision: as many as keep the product (and its fp32 copy) at ``chunk × vocab_local``
    elements, so the loss's temporaries stay O(chunk × vocab), never a head-sized matrix."""
    return max(1, min(vocab_local, chunk * vocab_local // max(1, hidden)))


def _accumulate_weight_grad(grad_w: torch.Tensor, g: torch.Tensor, h: torch.Tensor) -> None:
    """``grad_w += g.t() @ h``: in place when the dtypes agree (fp32); else the product in the
    compute dtype, one vocabulary slice at a time (``weight_grad_rows``), each added in fp32. Each
    output row is computed as the whole product would compute it: the same numbers."""
    if grad_w.dtype == g.dtype:
        grad_w.addmm_(g.t(), h)
        return
    rows = weight_grad_rows(g.shape[0], g.shape[1], h.shape[1])
    for v in range(0, g.shape[1], rows):
        grad_w[v : v + rows] += (g[:, v : v + rows].t() @ h).float()


class _ChunkedLinearCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, num_items, chunk, vocab_start, group):
        want_h, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        n_tok, v_local = hidden.shape[0], weight.shape[0]
        loss_sum = torch.zeros((), dtype=torch.float32, device=hidden.device)
        grad_h = torch.empty_like(hidden) if want_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if want_w else None
        for s in range(0, n_tok, chunk):
            h, y = hidden[s : s + chunk], labels[s : s + chunk]
            logits = (h @ weight.t()).float()  # (c, v_local); the one large buffer
            valid = y != IGNORE_INDEX
            local = y - vocab_start
            mine = valid & (local >= 0) & (local < v_local)
            idx = torch.where(mine, local, torch.zeros_like(local)).unsqueeze(1)
            target = logits.gather(1, idx).squeeze(1) * mine
            row_max = logits.amax(1)
            if group is not None:
                dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
            probs = logits.sub_(row_max.unsqueeze(1)).exp_()  # in place: exp(logit - max)
            sumexp = probs.sum(1)
            if group is not None:
                stats = torch.stack([sumexp, target])
                dist.all_reduce(stats, group=group)
                sumexp, target = stats[0], stats[1]
            loss_sum += ((sumexp.log() + row_max - target) * valid).sum()
            if want_h or want_w:
                scale = valid.float() / num_items  # d(loss)/d(token loss)
                grad_logits = probs.mul_((scale / sumexp).unsqueeze(1))  # softmax × scale
                grad_logits.scatter_add_(1, idx, -(scale * mine).unsqueeze(1))  # − one-hot
                g = grad_logits.to(weight.dtype)
                if want_h:
                    torch.matmul(g, weight, out=grad_h[s : s + chunk])
                if want_w:
                    _accumulate_weight_grad(grad_w, g, h)
            del logits, probs
        ctx.weight_dtype = weight.dtype
        ctx.save_for_backward(grad_h, grad_w)
        ctx.used = False
        return loss_sum / num_items

    @staticmethod
    def backward(ctx, grad_out):
        if ctx.used:
            raise RuntimeError("chunked_linear_cross_entropy: backward may run only once (no retain_graph)")
        ctx.used = True
        grad_h, grad_w = ctx.saved_tensors
        if grad_h is not None:
            grad_h = grad_h.mul_(grad_out.to(grad_h.dtype))
        if grad_w is not None:
            grad_w = grad_w.mul_(grad_out).to(ctx.weight_dtype)
        return grad_h, grad_w, None, None, None, None, None


def _vocab_parallel_inputs(hidden: torch.Tensor, weight: DTensor, sequence_parallel: bool):
    """Local hidden rows (all of this tp group's tokens), local weight shard, its first vocab id,
    the tp process group; the hidden-state gradient flows back as a ``Partial`` sum over tp."""
    mesh = weight.device_mesh
    if mesh.ndim != 1:
        raise ValueError(f"chunked loss: the LM-head weight must live on a 1-D tp mesh, got {mesh}")
    placement = weight.placements[0]
    if not isinstance(hidden, DTensor):
        hidden = DTensor.from_local(
            hidden, mesh, [Shard(1) if sequence_parallel else Replicate()], run_check=False
        )
    if hidden.placements != (Replicate(),):
        hidden = hidden.redistribute(mesh, [Replicate()])
    if placement == Shard(0):
        local = hidden.to_local(grad_placements=[Partial()])
        per = -(-weight.shape[0] // mesh.size())
        return local, weight.to_local(), min(mesh.get_local_rank() * per, weight.shape[0]), mesh.get_group()
    if placement == Replicate():
        return hidden.to_local(), weight.to_local(), 0, None
    raise ValueError(
        f"chunked loss: LM-head weight placement {placement} is not supported "
        "(Shard(0) = vocab-sharded, or Replicate)"
    )


def chunked_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    shift_labels: torch.Tensor,
    num_items_in_batch: int | torch.Tensor,
    chunk_tokens: int | None = None,
    sequence_parallel: bool = False,
) -> torch.Tensor:
    """Sum of token cross-entropies of ``hidden @ weight.T`` against ``shift_labels`` (−100
    ignored) / ``num_items_in_batch``; a plain fp32 scalar.

    ``hidden``: (..., S, H) final hidden states of this rank's tokens (sharded on dim 1 over tp
    under ``sequence_parallel``); ``weight``: the (V, H) LM-head weight, a plain
    tensor or a tp DTensor (``Shard(0)``: vocab-parallel, or ``Replicate``)."""
    group, vocab_start = None, 0
    if isinstance(weight, DTensor):
        hidden, weight, vocab_start, group = _vocab_parallel_inputs(hidden, weight, sequence_parallel)
        if group is not None and dist.get_world_size(group) == 1:
            group = None
    flat = hidden.reshape(-1, hidden.shape[-1])
    labels = shift_labels.reshape(-1).to(flat.device)
    if labels.shape[0] != flat.shape[0]:
        raise ValueError(f"chunked loss: {labels.shape[0]} labels for {flat.shape[0]} hidden states")
    if not isinstance(num_items_in_batch, torch.Tensor):
        num_items_in_batch = torch.tensor(float(num_items_in_batch), device=flat.device)
    num_items = num_items_in_batch.to(device=flat.device, dtype=torch.float32)
    chunk = chunk_tokens or default_chunk_tokens(weight.shape[0], flat.shape[0])
    return _ChunkedLinearCE.apply(flat, weight, labels, num_items, int(chunk), vocab_start, group)
