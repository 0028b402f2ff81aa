"""Can this model run under this layout exactly? One answer for the pre-launch checks (a meta-device
model, ``preflight/checks.py``) and for ``parallelize_model`` (the real model, Python API): a
problem is one line naming the degree and what to do instead; None when the layout applies.

What is checked beyond the degrees' arithmetic (``validate_tensor_parallel``,
``validate_context_parallel``):

* TP: the model has a plan ndparallel applies (``models.tp_plans.tp_plan_problem``: no plan,
  a plan that misses the decoder);
* TP or EP on a mixture-of-experts model: its experts can be split off (``parallel/ep/expert.py``:
  transformers' experts implementations, an expert count ``ep`` divides);
* TP + sequence parallel: the plan shards the attention (else it would read one sequence shard:
  DeepSeek-V3's plan covers its MLPs only);
* CP and TP + sequence parallel: ndparallel's own attention replaces the model's, which needs a
  model that calls attention through transformers' ``AttentionInterface`` (Falcon does not) and
  no attention sinks (gpt-oss).
"""

from __future__ import annotations

import copy

import torch.nn as nn

from ndparallel.models.adapters import checkpoint_key, is_param_wrapper
from ndparallel.models.causal import self_attention_flags
from ndparallel.models.moe import experts_modules
from ndparallel.models.tp_plans import match_plan, resolve_tp_plan, tp_plan_problem
from ndparallel.parallel.ep.expert import check_expert_parallel
from ndparallel.parallel.layout_refusals import saved_modules_problem
from ndparallel.parallel.options import TPOptions

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
        return (
            f"{what}: {name} uses attention sinks, which ndparallel's attention does not compute: "
            "train it without that degree"
        )
    if probe and not uses_attention_interface(model):
        return (
            f"{what}: {name} does not call attention through transformers' AttentionInterface, through "
            "which ndparallel's attention replaces it: train this model without that degree "
            "(FSDP / data parallel layouts work)"
        )
    return None


def _sp_attention_problem(model: nn.Module, tp_size: int, tp_plan) -> str | None:
    """Under sequence parallel a block's input is gathered only when its plan shards something in
    it: an attention the plan leaves out would read one sequence shard."""

    attention = [name for name, _ in self_attention_flags(model)][:1]
    try:
        styled = match_plan(model, resolve_tp_plan(model, tp_plan), strict=False)
    except ValueError:
        return None  # no plan: reported by tp_plan_problem
    if attention and not any(n.startswith(attention[0] + ".") for n in styled):
        return (
            f"tensor_parallel_size={tp_size} with sequence_parallel: {type(model).__name__}'s "
            f"tensor-parallel "
            f"plan shards nothing in its attention ({attention[0]}), which would then read one sequence "
            "shard: train it without sequence_parallel, or give a tp_plan for the attention"
        )
    return None


def _experts_problem(model: nn.Module, tp_size: int, ep_size: int) -> str | None:
    """Why a mixture-of-experts model's experts cannot be split off (EP, or TP: experts are never
    tensor-parallel), or None (also for a dense model under TP)."""

    if ep_size == 1 and not experts_modules(model):
        return None
    try:
        check_expert_parallel(model, ep_size)
    except ValueError as e:
        degree = f"expert_parallel_size={ep_size}" if ep_size > 1 else f"tensor_parallel_size={tp_size}"
        return f"{degree}: {e}"
    return None


def adapter_layout_problem(model: nn.Module, tp_size: int = 1, ep_size: int = 1) -> str | None:
    """Why LoRA's ``modules_to_save`` (trained copies of whole modules) or ``target_parameters``
    (LoRA on the experts' 3-D weights) cannot run under TP / EP, or None. Under TP the embedding
    and LM head are vocab-sharded and their PEFT copies would not be; under TP or EP the expert
    weights are split off while their LoRA factors hold every expert."""

    saved = sorted(
        {
            n.rsplit(".", 1)[-1]
            for n, m in model.named_modules()
            if hasattr(m, "original_module") and hasattr(m, "modules_to_save")
        }
    )
    wrapped = sorted(
        {
            ".".join(checkpoint_key(f"{n}.{m.parameter_name}").split(".")[-2:])
            for n, m in model.named_modules()
            if is_param_wrapper(m)
        }
    )
    problem = saved_modules_problem(saved, tp_size)
    if problem:
        return problem
    for degree, size in (("tensor_parallel_size", tp_size), ("expert_parallel_size", ep_size)):
        if wrapped and size > 1:
            return (
                f"{degree}={size}: LoRA on the experts' weights (lora_target_parameters: "
                f"{', '.join(wrapped)}) "
                f"needs them whole on each rank: set {degree}: 1 (shard them with dp_shard_size) or drop "
                "lora_target_parameters"
            )
    return None


def layout_problem(
    model: nn.Module,
    *,
    tp_size: int = 1,
    cp_size: int = 1,
    tp: TPOptions = TPOptions(),
    probe_attention: bool = True,
    ep_size: int = 1,
) -> str | None:
    """The first reason ``model`` cannot be trained exactly under this layout, or None.
    ``probe_attention``: build a meta-device copy to ask whether it takes transformers'
    ``AttentionInterface`` (off at run time: switching the real model's attention says it).
    ``tp``: the TP options (its plan, sequence parallel)."""

    base = getattr(model, "base_model", None) if hasattr(model, "peft_config") else None
    model = getattr(base, "model", model) if base is not None else model
    problem = adapter_layout_problem(model, tp_size, ep_size)
    if problem:
        return problem
    if tp_size > 1:
        problem = tp_plan_problem(model, tp.plan)
        if problem:
            return f"tensor_parallel_size={tp_size}: {problem}"
    if tp_size > 1 or ep_size > 1:
        problem = _experts_problem(model, tp_size, ep_size)
        if problem:
            return problem
    if cp_size > 1:
        return _own_attention_problem(model, f"context_parallel_size={cp_size}", probe_attention)
    if tp_size > 1 and tp.sequence_parallel:
        return _sp_attention_problem(model, tp_size, tp.plan) or _own_attention_problem(
            model, f"tensor_parallel_size={tp_size} with sequence_parallel", probe_attention
        )
    return None
