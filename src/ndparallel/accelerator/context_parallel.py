"""``maybe_context_parallel``: shard the batch over the cp ranks for one step and make sure the
model sees the *global* positions of its tokens. A script that (like Accelerate's CP guide) does
not pass ``position_ids`` gets them filled in, computed before sharding; ``position_ids`` that were
not sharded, and unshifted ``labels`` (the model would shift them after sharding, pairing tokens
with the wrong targets at every shard edge), are errors instead of a silently different loss
(``parallel.positions.position_hook``, the same hook sequence parallelism uses)."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch

from ndparallel.parallel.cp.sharding import cp_positions
from ndparallel.parallel.positions import position_hook


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
            raise ValueError(
                "context parallelism is on but maybe_context_parallel got no buffers: pass "
                "the batch tensors to shard (input_ids, shift_labels, ...)"
            )

        dims = list(buffer_seq_dims or [1] * len(buffers))
        lengths = {b.shape[d] for b, d in zip(buffers, dims)}
        if len(lengths) != 1:
            raise ValueError(
                f"maybe_context_parallel: buffers have different sequence lengths {sorted(lengths)}"
            )
        seq_len = lengths.pop()
        cp, lb = self.parallelism_config.cp_size, self.cp_options.load_balance
        with self.engine.cp_shard(list(buffers), dims, no_restore=no_restore_buffers):
            positions = cp_positions(seq_len, self.rank_in("cp"), cp, lb, device=self.device)
            hook = position_hook(cp_positions=positions)
            handles = [
                m.register_forward_pre_hook(hook, with_kwargs=True, prepend=True) for m in self._models
            ]
            try:
                yield
            finally:
                for h in handles:
                    h.remove()
