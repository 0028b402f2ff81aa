"""``maybe_context_parallel``: shard the batch over the cp ranks for one step and make sure the
model sees the *global* positions of its tokens. A script that (like Accelerate's CP guide) does
not pass ``position_ids`` gets them filled in, computed before sharding; ``position_ids`` that were
not sharded, and unshifted ``labels`` (the model would shift them after sharding, pairing tokens
with the wrong targets at every shard edge), are errors instead of a silently different loss."""

from __future__ import annotations

import contextlib
from typing import Sequence

import torch

_LABELS_MSG = (
    "context parallelism: `labels` without `shift_labels` would be shifted by the model *after* "
    "sequence sharding, pairing tokens with the wrong targets at every shard edge; pass pre-shifted "
    "labels as shift_labels (shift_labels[:, t] = labels[:, t+1], -100 at the end) in the buffers"
)


def _fill_positions_hook(positions: torch.Tensor, local_len: int):
    def hook(module, args, kwargs):
        ref = kwargs.get("input_ids")
        if ref is None:
            ref = args[0] if args else kwargs.get("inputs_embeds")
        if ref is None:
            return None
        if ref.shape[1] != local_len:
            raise ValueError(
                f"context parallelism: the model got a sequence of length {ref.shape[1]}, but this cp "
                f"rank's shard has {local_len} tokens: pass the inputs in maybe_context_parallel(buffers=...)"
            )
        if kwargs.get("labels") is not None and kwargs.get("shift_labels") is None:
            raise ValueError(_LABELS_MSG)
        pos = kwargs.get("position_ids")
        if len(args) > 2:
            pos = args[2]
        if pos is None:
            kwargs["position_ids"] = positions.to(ref.device).unsqueeze(0).expand(ref.shape[0], -1)
        elif pos.shape[-1] != local_len:
            raise ValueError(
                f"context parallelism: position_ids have length {pos.shape[-1]} but the sharded inputs "
                f"{local_len}: add position_ids to maybe_context_parallel(buffers=...) (or leave them "
                "out: they are then filled with the global positions)"
            )
        return args, kwargs
    return hook


class ContextParallelMixin:
    @contextlib.contextmanager
    def maybe_context_parallel(
        self,
        buffers: Sequence[torch.Tensor] | None = None,
        buffer_seq_dims: Sequence[int] | None = None,
        no_restore_buffers: set[torch.Tensor] | None = None,
    ):
        """Shard ``buffers`` IN PLACE along their sequence dims over the cp group for the block
        (load-balanced for causal attention) and give prepared models the global ``position_ids``
        of their tokens when the call passes none. A no-op without context parallelism."""
        if not self.parallelism_config.cp_enabled:
            yield
            return
        if not buffers:
            raise ValueError("context parallelism is on but maybe_context_parallel got no buffers: pass "
                             "the batch tensors to shard (input_ids, shift_labels, ...)")
        from ndparallel.parallel.cp_sharding import cp_positions

        dims = list(buffer_seq_dims or [1] * len(buffers))
        lengths = {b.shape[d] for b, d in zip(buffers, dims)}
        if len(lengths) != 1:
            raise ValueError(f"maybe_context_parallel: buffers have different sequence lengths {sorted(lengths)}")
        seq_len = lengths.pop()
        cp, lb = self.parallelism_config.cp_size, self.cp_options.load_balance
        with self.engine.cp_shard(list(buffers), dims, no_restore=no_restore_buffers):
            positions = cp_positions(seq_len, self.rank_in("cp"), cp, lb, device=self.device)
            hook = _fill_positions_hook(positions, seq_len // cp)
            handles = [m.register_forward_pre_hook(hook, with_kwargs=True) for m in self._models]
            try:
                yield
            finally:
                for h in handles:
                    h.remove()
