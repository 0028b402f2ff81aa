"""Find the blocks of a Hugging Face causal LM that parallel strategies wrap one by one."""

from __future__ import annotations

import torch.nn as nn


def decoder_layer_classes(model: nn.Module, override: tuple[str, ...] | None = None) -> set[str]:
    """Class names of the repeated blocks: ``override``, else the model's ``_no_split_modules``."""
    names = override or tuple(getattr(model, "_no_split_modules", None) or ())
    if not names:
        raise ValueError(
            f"{type(model).__name__} declares no _no_split_modules: name its decoder-layer class in "
            "fsdp_config.layer_classes (YAML) / FSDPOptions(layer_classes=('MyDecoderLayer',))"
        )
    return set(names)


def decoder_layers(model: nn.Module, override: tuple[str, ...] | None = None) -> list[nn.Module]:
    """The decoder-layer modules, in model order."""
    classes = decoder_layer_classes(model, override)
    layers = [m for m in model.modules() if type(m).__name__ in classes]
    if not layers:
        raise ValueError(
            f"no module of class {sorted(classes)} found in {type(model).__name__}: set "
            "fsdp_config.layer_classes to the decoder-layer class name"
        )
    return layers


_TOWERS = ("vision", "visual", "audio", "image", "speech", "multi_modal")


def decoder_module_name(model: nn.Module) -> str | None:
    """Name of the module that runs the decoder layers (holds them in a ``ModuleList``): ``model``
    for Llama and Llama 4, ``gpt_neox`` for GPT-NeoX, ``transformer`` for Falcon; ``""`` when that
    is ``model`` itself; None when no ``ModuleList`` of decoder layers is found. Found from the
    module tree, not ``base_model_prefix`` (Llama 4's says ``language_model``; the decoder is at
    ``model``); never inside a multimodal model's vision / audio tower (Voxtral's and Mistral 3's
    towers hold decoder-like layers too)."""
    classes = set(getattr(model, "_no_split_modules", None) or ())
    fallback = None
    for name, module in model.named_modules():
        if _in_tower(name):
            continue
        for child_name, child in module.named_children():
            if not isinstance(child, nn.ModuleList) or len(child) == 0:
                continue
            if type(child[0]).__name__ in classes:
                return name
            if fallback is None and child_name in ("layers", "h", "blocks"):
                fallback = name
    return fallback


def decoder_module(model: nn.Module) -> nn.Module | None:
    """The module that runs the decoder layers (``decoder_module_name``)."""
    name = decoder_module_name(model)
    return None if name is None else model.get_submodule(name)


def embedding_modules(model: nn.Module) -> list[nn.Module]:
    """The input embedding module(s)."""
    get = getattr(model, "get_input_embeddings", None)
    emb = get() if get else None
    return [emb] if emb is not None else []


def output_modules(model: nn.Module) -> list[nn.Module]:
    """The final norm (if found) and the output projection (lm_head)."""
    out = []
    base = getattr(model, "model", None) or getattr(model, getattr(model, "base_model_prefix", ""), None)
    norm = getattr(base, "norm", None) if base is not None else None
    if isinstance(norm, nn.Module):
        out.append(norm)
    get = getattr(model, "get_output_embeddings", None)
    head = get() if get else None
    if head is not None:
        out.append(head)
    return out


def outer_decoder_layers(model: nn.Module, override: tuple[str, ...] | None = None) -> list[nn.Module]:
    """``decoder_layers`` without the blocks listed inside another one (a ``layer_classes`` that
    also names a sub-block, e.g. the MLP, to shard it separately) and without a multimodal model's
    tower blocks (a text batch never runs them): the blocks a text forward runs."""
    layers = decoder_layers(model, override)
    nested = {id(m) for layer in layers for m in layer.modules() if m is not layer}
    towers = {id(m) for name, m in model.named_modules() if _in_tower(name)}
    return [layer for layer in layers if id(layer) not in nested and id(layer) not in towers]


def _in_tower(name: str) -> bool:
    return any(part.startswith(_TOWERS) for part in name.split("."))


_MOE_CHILDREN = ("experts", "router", "shared_expert", "shared_experts")


def dense_mlps(model: nn.Module, override: tuple[str, ...] | None = None) -> list[nn.Module]:
    """The dense feed-forward block (``mlp``) of every decoder layer, in model order; ValueError
    naming the layer class when a layer has none or a mixture-of-experts block."""
    out = []
    for layer in outer_decoder_layers(model, override):
        mlp = getattr(layer, "mlp", None)
        if not isinstance(mlp, nn.Module):
            raise ValueError(
                f"{type(layer).__name__} has no `mlp` feed-forward block: tiled_mlp supports "
                "decoder layers with a dense `mlp` (Llama, Qwen, Mistral, ...); turn it off"
            )
        if any(name in _MOE_CHILDREN for name, _ in mlp.named_children()):
            raise ValueError(
                f"{type(mlp).__name__} is a mixture-of-experts block: tiled_mlp supports dense "
                "MLPs only; turn it off for this model"
            )
        out.append(mlp)
    return out
