"""The positions of the tokens a model holds, for every layout.

* ``position_hook``: the one forward pre-hook that completes a model call's inputs for the layout.
  Under context parallelism (a rank holds a load-balanced shard of the sequence) it fills in the
  shard's *global* positions when the call passes none (Accelerate's CP guide does not pass them)
  and refuses inputs that were not sharded or labels that were not shifted before sharding; under
  sequence parallelism (transformers would number the tokens of its *local* shard) it fills in
  ``0 .. S-1``, checks that S divides over the tp ranks and drops an all-ones attention mask (a
  padding mask is refused: pack with ``position_ids``).
* ``PositionRecorder``: the ``position_ids`` the decoder was called with, for ndparallel's
  attention. Some decoder layers do not pass them on to attention (Llama 4, Cohere 2); the
  document masks (packed rows) are derived from them, so the attention reads them here when its
  call has none. It is the decoder's own input (after the hook above), recorded by a forward
  pre-hook on the module that runs the decoder layers; a recomputation under activation
  checkpointing runs before the next forward, so it sees the same positions.
"""

from __future__ import annotations

import torch
from torch import nn

from ndparallel.models.layers import decoder_module

_LABELS_MSG = (
    "context parallelism: `labels` without `shift_labels` would be shifted by the model *after* "
    "sequence sharding, pairing tokens with the wrong targets at every shard edge; pass pre-shifted "
    "labels as shift_labels (shift_labels[:, t] = labels[:, t+1], -100 at the end) in the buffers"
)


def _input_tokens(args, kwargs):
    ids = kwargs.get("input_ids", args[0] if args else None)
    return kwargs.get("inputs_embeds") if ids is None else ids


def _check_sequence_parallel(kwargs: dict, seq: int, sp_size: int) -> dict:
    if seq % sp_size:
        raise ValueError(
            f"sequence parallel: sequence length {seq} is not divisible by tp_size={sp_size}; "
            f"pad the batch to a multiple of {sp_size} (or disable sequence_parallel)"
        )
    mask = kwargs.get("attention_mask")
    if isinstance(mask, torch.Tensor) and mask.dim() == 2:
        if not bool(mask.all()):
            raise ValueError(
                "sequence parallel does not support padding attention masks (HF builds the mask "
                "from the local sequence length): pack sequences with position_ids instead, or "
                "disable sequence_parallel"
            )
        kwargs = {**kwargs, "attention_mask": None}  # all ones: plain causal attention
    return kwargs


def _check_context_parallel(args, kwargs: dict, seq: int, local_len: int) -> None:
    if seq != local_len:
        raise ValueError(
            f"context parallelism: the model got a sequence of length {seq}, but this cp rank's "
            f"shard has {local_len} tokens: pass the inputs in maybe_context_parallel(buffers=...)"
        )
    if kwargs.get("labels") is not None and kwargs.get("shift_labels") is None:
        raise ValueError(_LABELS_MSG)
    pos = args[2] if len(args) > 2 else kwargs.get("position_ids")
    if pos is not None and pos.shape[-1] != local_len:
        raise ValueError(
            f"context parallelism: position_ids have length {pos.shape[-1]} but the sharded inputs "
            f"{local_len}: add position_ids to maybe_context_parallel(buffers=...) (or leave them "
            "out: they are then filled with the global positions)"
        )


def position_hook(*, sp_size: int = 1, cp_positions: torch.Tensor | None = None):
    """A forward pre-hook (``with_kwargs=True``) for a causal LM under sequence parallelism
    (``sp_size`` = tp ranks) and/or context parallelism (``cp_positions``: the global positions
    of this rank's shard, ``cp.sharding.cp_positions``): checks the call and fills in missing
    ``position_ids`` (see the module doc). Register it before any other pre-hook that reads them
    (``prepend=True``)."""
    local_len = None if cp_positions is None else cp_positions.numel()

    def hook(_module, args, kwargs):
        ids = _input_tokens(args, kwargs)
        if ids is None:
            return None
        seq = ids.shape[1]
        if local_len is not None:
            _check_context_parallel(args, kwargs, seq, local_len)
        if sp_size > 1:
            kwargs = _check_sequence_parallel(kwargs, seq, sp_size)
        if kwargs.get("position_ids") is None and not len(args) > 2:
            pos = (
                cp_positions.to(ids.device)
                if cp_positions is not None
                else torch.arange(seq, device=ids.device)
            )
            kwargs = {**kwargs, "position_ids": pos.unsqueeze(0).expand(ids.shape[0], -1)}
        return args, kwargs

    return hook


class PositionRecorder:
    """The ``position_ids`` of the current forward of a model's decoder (None: none given, plain
    causal). ``attach`` hooks it onto the module that runs the decoder layers."""

    def __init__(self):
        self.value: torch.Tensor | None = None

    def _record(self, _module, _args, kwargs):
        self.value = kwargs.get("position_ids")  # transformers calls its decoder with keywords

    def attach(self, model: nn.Module) -> PositionRecorder:

        decoder = decoder_module(model)
        (decoder if decoder is not None else model).register_forward_pre_hook(self._record, with_kwargs=True)
        return self

    def positions(self, kwargs: dict) -> torch.Tensor | None:
        """The call's own ``position_ids`` if the layer passed them, else the decoder's."""
        pos = kwargs.get("position_ids")
        return self.value if pos is None else pos
