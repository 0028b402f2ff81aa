"""Sequence sharding for context parallelism (load-balanced for causal attention).

With ``load_balance=True`` a sequence is cut into ``2·cp`` equal chunks and cp rank ``i`` keeps
chunks ``i`` and ``2·cp−1−i`` (concatenated in that order), so every rank gets the same amount of
causal-attention work. With ``load_balance=False`` rank ``i`` keeps the contiguous chunk ``i`` of
``cp``. Labels must be shifted *before* sharding (``shift_labels[t]`` = token ``t+1``) and
``position_ids`` must carry global positions; ``pad_for_cp`` makes the length divisible.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from ndparallel.layout.mesh import process_group
from ndparallel.techniques.loss import IGNORE_INDEX


def cp_chunk_ids(cp_rank: int, cp_size: int, load_balance: bool = True) -> tuple[int, ...]:
    """Global chunk indices held by ``cp_rank``, in local order."""
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank={cp_rank} is outside [0, cp_size={cp_size})")
    return (cp_rank, 2 * cp_size - 1 - cp_rank) if load_balance else (cp_rank,)


def cp_num_chunks(cp_size: int, load_balance: bool = True) -> int:
    """Number of chunks a sequence is cut into; its length must be a multiple of this."""
    return 2 * cp_size if load_balance else cp_size


def _check_len(seq_len: int, cp_size: int, load_balance: bool, what: str = "sequence") -> int:
    n = cp_num_chunks(cp_size, load_balance)
    if seq_len % n:
        raise ValueError(
            f"{what} length {seq_len} is not a multiple of {'2·cp' if load_balance else 'cp'} = {n} "
            f"(cp_size={cp_size}); pad it with ndparallel.parallel.cp.sharding.pad_for_cp or choose "
            f"a sequence_len divisible by {n}"
        )
    return seq_len // n


def shard_for_cp(
    tensor: torch.Tensor, seq_dim: int, cp_rank: int, cp_size: int, load_balance: bool = True
) -> torch.Tensor:
    """This rank's part of ``tensor`` along ``seq_dim`` (a new contiguous tensor)."""
    chunk = _check_len(tensor.shape[seq_dim], cp_size, load_balance)
    parts = [tensor.narrow(seq_dim, c * chunk, chunk) for c in cp_chunk_ids(cp_rank, cp_size, load_balance)]
    return torch.cat(parts, dim=seq_dim).contiguous()


def cp_positions(
    seq_len: int, cp_rank: int, cp_size: int, load_balance: bool = True, device=None
) -> torch.Tensor:
    """Global positions (int64, shape ``[seq_len // cp]``) of the tokens ``cp_rank`` holds; built
    from this rank's chunks alone (O(seq_len / cp) memory)."""
    chunk = _check_len(seq_len, cp_size, load_balance)
    return torch.cat(
        [
            torch.arange(c * chunk, (c + 1) * chunk, device=device)
            for c in cp_chunk_ids(cp_rank, cp_size, load_balance)
        ]
    )


def reorder_cp_chunks(
    gathered: torch.Tensor, seq_dim: int, cp_size: int, load_balance: bool = True
) -> torch.Tensor:
    """Rank-major concatenation of all shards (as an all-gather returns it) -> natural order."""
    nloc = 2 if load_balance else 1
    chunk = _check_len(gathered.shape[seq_dim], cp_size, load_balance)
    by_id: dict[int, torch.Tensor] = {}
    for r in range(cp_size):
        for j, c in enumerate(cp_chunk_ids(r, cp_size, load_balance)):
            by_id[c] = gathered.narrow(seq_dim, (r * nloc + j) * chunk, chunk)
    return torch.cat([by_id[c] for c in range(len(by_id))], dim=seq_dim)


def unshard_from_cp(
    tensor: torch.Tensor, seq_dim: int, cp_group=None, load_balance: bool = True
) -> torch.Tensor:
    """Inverse of ``shard_for_cp``: all-gather the shards of ``cp_group`` (a ProcessGroup or 1-D
    DeviceMesh) and restore the natural order. No autograd; for tests, eval and metrics."""
    import torch.distributed as dist

    group = process_group(cp_group)
    cp_size = dist.get_world_size(group)
    local = tensor.contiguous()
    parts = [torch.empty_like(local) for _ in range(cp_size)]
    dist.all_gather(parts, local, group=group)
    return reorder_cp_chunks(torch.cat(parts, dim=seq_dim), seq_dim, cp_size, load_balance)


def gather_from_cp(tensor: torch.Tensor, seq_dim: int, cp_group, load_balance: bool = True) -> torch.Tensor:
    """Inverse of ``shard_for_cp`` with autograd: every rank of ``cp_group`` (a ProcessGroup or 1-D
    DeviceMesh) gets the whole sequence, in natural order. The backward sums the incoming gradients
    of the cp ranks and hands each rank its shard's part (the adjoint of a gather): a loss that every
    cp rank computes alike from the whole sequence, averaged over the cp ranks, back-propagates
    exactly its one-process gradient."""
    import torch.distributed._functional_collectives as funcol

    gather = getattr(funcol, "all_gather_single_autograd", None) or funcol.all_gather_tensor_autograd
    group = process_group(cp_group)
    local = tensor.movedim(seq_dim, 0).contiguous()  # the collective gathers along dim 0
    gathered = gather(local, 0, group)
    if isinstance(gathered, funcol.AsyncCollectiveTensor):
        gathered = gathered.wait()
    cp_size = gathered.shape[0] // local.shape[0]
    return reorder_cp_chunks(gathered, 0, cp_size, load_balance).movedim(0, seq_dim)


_PAD_DEFAULTS = {"labels": IGNORE_INDEX, "shift_labels": IGNORE_INDEX, "attention_mask": 1}


def pad_for_cp(
    batch: Mapping[str, torch.Tensor],
    cp_size: int,
    pad_token_id: int,
    ignore_index: int = IGNORE_INDEX,
    load_balance: bool = True,
    seq_dim: int = 1,
    extra_pad_values: Mapping[str, int | float] | None = None,
    multiple_of: int | None = None,
) -> dict[str, torch.Tensor]:
    """Right-pad every sequence tensor of ``batch`` to a multiple of 2·cp (cp without load balance),
    or of ``multiple_of`` when given (a layout's ``ParallelDims.seq_len_divisor``: CP and sequence
    parallel together).

    ``input_ids`` get ``pad_token_id``; ``labels``/``shift_labels`` get ``ignore_index`` (the padding
    adds no loss); ``position_ids`` continue counting (``last+1, last+2, ...``), so padded tokens sit
    causally *after* every real token and cannot change its output; ``attention_mask`` is padded
    with 1 for that reason (CP attention accepts no padding mask). Other tensors with the sequence
    length need a value in ``extra_pad_values``, else ValueError: nothing is truncated or guessed.
    Returns a new dict; non-tensor values and tensors of other shapes are passed through.
    """
    if "input_ids" not in batch:
        raise ValueError("pad_for_cp needs batch['input_ids'] to know the sequence length")
    seq_len = batch["input_ids"].shape[seq_dim]
    n = multiple_of or cp_num_chunks(cp_size, load_balance)
    pad = (-seq_len) % n
    values = {
        **_PAD_DEFAULTS,
        "labels": ignore_index,
        "shift_labels": ignore_index,
        "input_ids": pad_token_id,
        **(extra_pad_values or {}),
    }
    out: dict[str, torch.Tensor] = {}
    for key, t in batch.items():
        if not isinstance(t, torch.Tensor) or t.dim() <= seq_dim or t.shape[seq_dim] != seq_len:
            out[key] = t
            continue
        if pad == 0:
            out[key] = t
        elif key == "position_ids":
            last = t.narrow(seq_dim, seq_len - 1, 1)
            steps = torch.arange(1, pad + 1, device=t.device, dtype=t.dtype)
            shape = [1] * t.dim()
            shape[seq_dim] = pad
            out[key] = torch.cat([t, last + steps.view(shape)], dim=seq_dim)
        elif key in values:
            shape = list(t.shape)
            shape[seq_dim] = pad
            out[key] = torch.cat([t, t.new_full(shape, values[key])], dim=seq_dim)
        else:
            raise ValueError(
                f"pad_for_cp: batch[{key!r}] has the sequence length {seq_len} on dim {seq_dim} but no "
                f"pad value is known for it; pass extra_pad_values={{{key!r}: value}}"
            )
    return out
