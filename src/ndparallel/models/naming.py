"""Names of a (possibly wrapped) model's class and of its tied parameters. No parallel code here."""

from __future__ import annotations

import torch.nn as nn


def model_class_name(model: nn.Module) -> str:
    """The HF class name of a (possibly FSDP-wrapped) model, e.g. ``LlamaForCausalLM`` (a pipeline
    stage view names the model it was cut from: ``hf_class_name``)."""
    if getattr(model, "hf_class_name", None):
        return model.hf_class_name
    for cls in type(model).__mro__:
        if not cls.__name__.startswith("FSDP"):
            return cls.__name__
    return type(model).__name__


def tied_parameter_groups(model: nn.Module) -> list[list[tuple[str, str]]]:
    """Parameters that several modules share (tied embeddings), each as a sorted list of
    ``(module name, parameter name)`` locations; the first location is the one HF keeps."""
    where: dict[int, list[tuple[str, str]]] = {}
    for mod_name, module in model.named_modules(remove_duplicate=False):
        for p_name, p in module.named_parameters(recurse=False):
            where.setdefault(id(p), []).append((mod_name, p_name))
    return [sorted(set(v)) for v in where.values() if len(set(v)) > 1]


def tied_aliases(model: nn.Module) -> set[str]:
    """Full names of parameters that are the same object as an earlier one in
    ``named_parameters`` order (e.g. ``lm_head.weight`` when tied): what HF does not save."""
    seen: set[int] = set()
    aliases = set()
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            aliases.add(name)
        seen.add(id(p))
    return aliases


def share_parameters(a: list[nn.Module], b: list[nn.Module]) -> bool:
    """True when the two module groups share a parameter (e.g. tied embedding and LM head)."""
    ids = {id(p) for m in a for p in m.parameters()}
    return any(id(p) in ids for m in b for p in m.parameters())
