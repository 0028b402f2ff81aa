"""Can this model run under this layout exactly? One answer for the pre-launch checks (a meta-device
model, ``training/preflight.py``) and for ``parallelize_model`` (the real model, Python API): a
problem is one line naming the degree and what to do instead; None when the layout applies.

What is checked beyond the degrees' arithmetic (``validate_tensor_parallel``,
``validate_context_parallel``):

* TP: the model has a plan ndparallel applies (``models.tp_plans.tp_plan_problem``: no plan,
  mixture-of-experts expert styles, a plan that misses the decoder);
* CP and TP + sequence parallel: ndparallel's own attention replaces the model's, which needs a
  model that calls attention through transformers' ``AttentionInterface`` (Falcon does not) and
  no attention sinks (gpt-oss).
"""

from __future__ import annotations

import copy

import torch.nn as nn

_PROBE = "ndparallel_interface_probe"


def _probe(*_args, **_kwargs):  # never called: registered only to ask a model to switch to it
    raise RuntimeError("ndparallel's attention-interface probe was called")


def uses_attention_interface(model: nn.Module) -> bool:
    """Whether ``model`` accepts an attention function registered in transformers'
    ``AttentionInterface`` (asked on a meta-device copy: ``set_attn_implementation``)."""
    import torch
    from transformers import AttentionInterface

    AttentionInterface.register(_PROBE, _probe)
    config = copy.deepcopy(getattr(model, "config", None))
    if config is None:
        return False
    with torch.device("meta"):
        probe = type(model)._from_config(config) if hasattr(type(model), "_from_config") else None
    if probe is None:
        return False
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # "does not support setting its attention implementation": said below
    try:
        probe.set_attn_implementation(_PROBE)
    except (ValueError, TypeError, ImportError):
        return False
    finally:
        hf_logging.set_verbosity(level)
    return probe.config._attn_implementation == _PROBE


def _own_attention_problem(model: nn.Module, what: str, probe: bool) -> str | None:
    name = type(model).__name__
    if any(n.endswith(".sinks") or n == "sinks" for n, _ in model.named_parameters()):
        return (f"{what}: {name} uses attention sinks, which ndparallel's attention does not compute: "
                "train it without that degree")
    if probe and not uses_attention_interface(model):
        return (f"{what}: {name} does not call attention through transformers' AttentionInterface, through "
                "which ndparallel's attention replaces it: train this model without that degree "
                "(FSDP / data parallel layouts work)")
    return None


def layout_problem(model: nn.Module, *, tp_size: int = 1, cp_size: int = 1, sequence_parallel: bool = False,
                   tp_plan=None, probe_attention: bool = True) -> str | None:
    """The first reason ``model`` cannot be trained exactly under this layout, or None.
    ``probe_attention``: build a meta-device copy to ask whether it takes transformers'
    ``AttentionInterface`` (off at run time: switching the real model's attention says it)."""
    from ndparallel.models.tp_plans import tp_plan_problem

    base = getattr(model, "base_model", None) if hasattr(model, "peft_config") else None
    model = getattr(base, "model", model) if base is not None else model
    if tp_size > 1:
        problem = tp_plan_problem(model, tp_plan)
        if problem:
            return f"tensor_parallel_size={tp_size}: {problem}"
    if cp_size > 1:
        return _own_attention_problem(model, f"context_parallel_size={cp_size}", probe_attention)
    if tp_size > 1 and sequence_parallel:
        return _own_attention_problem(model, f"tensor_parallel_size={tp_size} with sequence_parallel",
                                      probe_attention)
    return None
