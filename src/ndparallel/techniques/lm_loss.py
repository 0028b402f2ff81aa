"""The causal-LM loss of one forward, computed without the full logits where that is exact.

``forward_loss`` runs the model once (its own forward, so every FSDP / TP / CP hook fires as
usual) with ``logits_to_keep=1`` — the LM head projects one position, not the whole sequence — and
reads the final hidden states from the decoder's output through a forward hook. The loss is then
``chunked_linear_cross_entropy(hidden, lm_head.weight, ...)``:

* FSDP: the LM head's group (and the root, which holds a tied head) is never resharded after
  forward (``fsdp.apply_fsdp``), so right after the forward its weight is the gathered parameter
  whose gradient FSDP reduce-scatters in backward. In a no-grad forward (evaluation) FSDP
  reshards everything at the end, so the head's group is gathered again for the loss
  (``fsdp.gathered``).
* TP: the weight is the vocab-sharded ``Shard(0)`` DTensor: the loss is vocab-parallel (loss
  parallel, whatever ``TPOptions.loss_parallel`` says); under sequence parallel the hidden states
  are all-gathered over tp first, as the LM head itself would.
* CP: every rank scores its own sequence shard, like the logits path.

Where the chunked loss would not be exact (``ndparallel.models.heads``) or is switched off,
``Accelerator.forward_loss`` takes the plain path instead: full logits and ``causal_lm_loss``.
The FSDP knowledge comes in as the ``gathered`` context (``fsdp.gathered``), passed by the
Accelerator, so this module calls into no other strategy.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping

import torch
import torch.nn as nn

from ndparallel.models.heads import plain_head_problem
from ndparallel.techniques.chunked_ce import chunked_linear_cross_entropy
from ndparallel.techniques.technique_options import LossOptions

MODEL_INPUTS = ("input_ids", "inputs_embeds", "position_ids", "attention_mask")
"""What a batch gives the model; ``inputs_embeds`` (hidden states) on a later pipeline stage."""


def use_chunked_loss(model: nn.Module, options: LossOptions) -> bool:
    """Resolve ``options.chunked`` for ``model``: None → where exact; True → required."""
    if options.chunked is False:
        return False
    problem = plain_head_problem(model)
    if problem and options.chunked:
        raise ValueError(
            f"chunked_loss: true, but the chunked loss would not be exact for this model: "
            f"{problem}; set chunked_loss: false (LossOptions(chunked=False))"
        )
    return problem is None


def model_inputs(batch: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: batch[k] for k in MODEL_INPUTS if k in batch}


def forward_loss(
    model: nn.Module,
    batch: Mapping[str, torch.Tensor],
    num_items_in_batch: int | torch.Tensor,
    chunk_tokens: int | None = None,
    sequence_parallel: bool = False,
    gathered=contextlib.nullcontext,
) -> torch.Tensor:
    """This rank's token-loss sum / ``num_items_in_batch`` for ``batch`` (``input_ids``,
    ``shift_labels``, optional ``position_ids`` / ``attention_mask``), the chunked way.
    ``sequence_parallel``: the option resolved for this model (TP on): the final hidden states are
    sharded on the sequence over TP. ``gathered(module)`` is the context that keeps an FSDP-sharded module
    gathered."""
    decoder = model.get_decoder()
    captured: dict[str, torch.Tensor] = {}

    def keep_hidden(_module, _args, output):
        captured["hidden"] = output.last_hidden_state if hasattr(output, "last_hidden_state") else output[0]

    handle = decoder.register_forward_hook(keep_hidden)
    try:
        model(**model_inputs(batch), logits_to_keep=1, use_cache=False)
    finally:
        handle.remove()
    head = model.get_output_embeddings()
    with gathered(head), gathered(model):
        return chunked_linear_cross_entropy(
            captured["hidden"],
            head.weight,
            batch["shift_labels"],
            num_items_in_batch,
            chunk_tokens=chunk_tokens,
            sequence_parallel=sequence_parallel,
        )
