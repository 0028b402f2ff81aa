"""Whole-sequence calls, for a trainer whose loss is a function of whole-sequence sums (DPO's: the
log-probability of each completion, ``parallel_trainer(..., splits_sequences=False)``): its batches
stay whole, and each call of a prepared model splits the sequence itself. A forward pre-hook pads the
call's ``input_ids`` to what the layout divides (``ParallelDims.seq_len_divisor``), shifts its
``labels`` into ``shift_labels`` and gives the global ``position_ids``, and hands the model this cp
rank's shard of each; a forward hook gathers every per-token output back to the caller's length, with
autograd (``cp.sharding.gather_from_cp``). So the trainer's maths runs on whole sequences as in one
process — every cp rank computes the same loss — and each cp rank's backward reaches its own tokens.

A right-padding ``attention_mask`` (TRL's preference collator pads on the right) is dropped: in a
causal model no real token attends to the padding after it, and positions whose input is padding
score nothing (their labels are ignored). Other padding, and other columns with the sequence length,
are refused. TRL's fused LM head (``fused_lm_head=True``) returns one value fewer than the length for
unshifted labels; the gathered outputs keep that convention, and its ``loss`` is recomputed over the
whole sequences the way TRL defines it (a model's own loss, or a router load-balancing loss, over a
shard is refused)."""

from __future__ import annotations

import torch
from torch import nn

from ndparallel.parallel.cp.sharding import gather_from_cp, pad_for_cp, shard_for_cp
from ndparallel.techniques.loss import IGNORE_INDEX
from ndparallel.transformers.door_batches import shift

_WHERE = "a whole-sequence trainer's model call (splits_sequences=False)"


def _padding_problem(mask: torch.Tensor) -> str | None:
    if mask.dim() != 2:
        return f"{_WHERE}: a {mask.dim()}-D attention_mask cannot be split over the ranks"
    if bool((mask[:, 1:] > mask[:, :-1]).any()):  # a 0 before a 1: padding on the left or inside
        return (
            f"{_WHERE}: the attention_mask pads rows on the left or inside, which a split sequence "
            "cannot take; pad on the right (padding_side='right')"
        )
    return None


class WholeSequenceCalls:
    """The hooks that split each call of a prepared model over the cp ranks and gather its per-token
    outputs back (see the module docstring); ``register`` them on each model once."""

    def __init__(self, accelerator):
        engine = accelerator.engine
        dims, options = engine.dims, engine.options
        self.load_balance = options.cp.load_balance
        self.divisor = dims.seq_len_divisor(options.tp.sequence_parallel, self.load_balance)
        self.cp_size = dims.cp
        self.cp_rank = accelerator.rank_in("cp")
        self.cp_group = accelerator.mesh("cp").get_group() if dims.cp_enabled else None
        self._calls: list[tuple[int, bool]] = []  # (the caller's length, labels given unshifted)

    @property
    def needed(self) -> bool:
        """Whether the layout splits or pads sequences at all."""
        return self.divisor > 1

    def register(self, model: nn.Module) -> None:
        model.register_forward_pre_hook(self.split, with_kwargs=True, prepend=True)
        model.register_forward_hook(self.gather, with_kwargs=True)

    # ------------------------------------------------------------------ into the model
    def split(self, _module, args, kwargs):
        if args:
            kwargs = {"input_ids": args[0], **kwargs}
            if len(args) > 1:
                raise ValueError(f"{_WHERE}: pass the model's inputs by name, not by position")
        ids = kwargs.get("input_ids")
        if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
            raise ValueError(f"{_WHERE}: the call needs input_ids of shape (batch, sequence)")
        length = ids.shape[1]
        labels, shift_labels = kwargs.pop("labels", None), kwargs.pop("shift_labels", None)
        unshifted = shift_labels is None and labels is not None
        if unshifted:
            shift_labels = shift(labels)
        mask = kwargs.pop("attention_mask", None)
        if isinstance(mask, torch.Tensor):
            problem = _padding_problem(mask)
            if problem:
                raise ValueError(problem)
            if shift_labels is not None:  # what a padded position predicts is not scored
                shift_labels = shift_labels.masked_fill(mask == 0, IGNORE_INDEX)
        positions = kwargs.pop("position_ids", None)
        if positions is None:
            positions = torch.arange(length, device=ids.device).expand(ids.shape[0], -1)
        other = [
            k
            for k, v in kwargs.items()
            if k != "input_ids" and isinstance(v, torch.Tensor) and v.dim() > 1 and v.shape[1] == length
        ]
        if other:
            raise ValueError(
                f"{_WHERE}: input {other[0]!r} has the sequence length, and nothing splits it over "
                "the ranks: the call takes input_ids, labels / shift_labels, position_ids"
            )
        batch = {"input_ids": kwargs.pop("input_ids"), "position_ids": positions}
        if shift_labels is not None:
            batch["shift_labels"] = shift_labels
        batch = pad_for_cp(batch, 1, pad_token_id=0, multiple_of=self.divisor)
        if self.cp_group is not None:
            rank, size, balance = self.cp_rank, self.cp_size, self.load_balance
            batch = {k: shard_for_cp(v, 1, rank, size, balance) for k, v in batch.items()}
        self._calls.append((length, unshifted))
        return (), {**kwargs, **batch}

    # ----------------------------------------------------------------- out of the model
    def gather(self, _module, _args, kwargs, output):
        length, unshifted = self._calls.pop()
        local = kwargs["input_ids"].shape[1]
        fused = getattr(output, "label_mask", None) is not None  # TRL's fused LM head
        keep = length - 1 if unshifted and fused else length
        split = self.cp_group is not None
        if split and getattr(output, "aux_loss", None) is not None:
            raise ValueError(
                f"{_WHERE}: a router load-balancing loss (output_router_logits) over split sequences "
                "is not the whole sequences' one: set output_router_logits=False, or cp_size=1"
            )
        fields = {}
        for key, value in output.items():
            if isinstance(value, torch.Tensor) and value.dim() > 1 and value.shape[1] == local:
                value = self._whole(value)[:, :keep]
            fields[key] = value
        if split and fields.get("loss") is not None:
            if not fused:
                raise ValueError(
                    f"{_WHERE}: the model's own loss would be its shard's; compute the loss from the "
                    "gathered outputs (TRL: fused_lm_head=True), or set cp_size=1"
                )
            num_items = kwargs.get("num_items_in_batch")
            count = fields["label_mask"].sum().clamp(min=1) if num_items is None else num_items
            fields["loss"] = -fields["log_probs"].sum() / count
        return type(output)(**fields)

    def _whole(self, value: torch.Tensor) -> torch.Tensor:
        if self.cp_group is None:  # padded only (sequence parallel)
            return value
        if value.dtype == torch.bool:  # gathered as bytes, no gradient
            return self._whole(value.to(torch.uint8)).bool()
        return gather_from_cp(value, 1, self.cp_group, self.load_balance)
