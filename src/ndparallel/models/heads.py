"""Whether a model's logits are exactly ``lm_head(final hidden states)``. No parallel code here.

The chunked loss (``ndparallel.techniques.lm_loss``) recomputes the logits from the final hidden
states and the LM-head weight, so it is exact only where the model's forward does nothing else to
them: no final soft-capping (Gemma 2/3), no logit scaling (Cohere, Granite), a bias-free linear
head. The families below were checked against their transformers 5 forward (the multimodal
Mistral 3 and Voxtral classes: ``lm_head`` of the language model's output, tests/test_multimodal.py).
"""

from __future__ import annotations

import torch.nn as nn

from ndparallel.models.adapters import trained_module

PLAIN_HEAD_FAMILIES = frozenset(
    {
        "llama",
        "mistral",
        "ministral",
        "mixtral",
        "qwen2",
        "qwen2_moe",
        "qwen3",
        "qwen3_moe",
        "phi3",
        "olmo2",
        "gemma",
        "smollm3",
        "starcoder2",
        "mistral3",
        "voxtral",
    }
)


def plain_head_problem(model: nn.Module) -> str | None:
    """None when ``logits == lm_head(hidden)`` holds for ``model``; else the reason it does not."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in PLAIN_HEAD_FAMILIES:
        return f"model_type {model_type!r} is not among the families with a plain LM head"
    if getattr(config, "final_logit_softcapping", None):
        return "the model soft-caps its logits (final_logit_softcapping)"
    get_head, get_decoder = getattr(model, "get_output_embeddings", None), getattr(model, "get_decoder", None)
    head = trained_module(get_head()) if callable(get_head) else None
    if not isinstance(head, nn.Linear) or head.bias is not None:
        return "the output embedding is not a bias-free nn.Linear"
    if type(head).forward is not nn.Linear.forward:  # e.g. QAT's fake-quantised linear
        return f"the LM head computes more than a matmul ({type(head).__name__})"
    if not callable(get_decoder) or get_decoder() is None:
        return "the model has no get_decoder() to read the final hidden states from"
    return None
