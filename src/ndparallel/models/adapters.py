"""LoRA adapters through PEFT: the adapter config from Axolotl's field names, wrapping a model, and
the names PEFT gives what it wraps. Model-side knowledge only (no parallel code); ``peft`` is
imported only when an adapter is used (``pip install 'ndparallel[lora]'``).

PEFT wraps each targeted ``nn.Linear`` in place: ``...q_proj`` becomes a ``lora.Linear`` holding
``q_proj.base_layer`` (the frozen original), ``q_proj.lora_A.default`` (in → r) and
``q_proj.lora_B.default`` (r → out), and the model inside a ``PeftModel`` (``base_model.model.``).
The strategies parallelise the inner Hugging Face model (``base_model_of``), so module names and
TP plans stay the model's own.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from typing import Any, NamedTuple

import torch
import torch.nn as nn

from ndparallel.models.moe import experts_modules
from ndparallel.runtime.extras import require

ADAPTER_NAME = "default"
ALL_LINEAR = "all-linear"
"""PEFT's name for every linear layer but the output head; here also allowed inside a list."""


def require_peft():
    """The peft module; ``MissingExtra`` naming the lora extra where it is not installed."""
    require("lora", "LoRA")
    import peft

    return peft


def lora_config(
    r: int = 8,
    alpha: float = 16,
    dropout: float = 0.0,
    target_modules: Iterable[str] | str | None = None,
    target_linear: bool = False,
    use_rslora: bool = False,
    modules_to_save: Iterable[str] | None = None,
    target_parameters: Iterable[str] | None = None,
    revision: str | None = None,
):
    """A PEFT ``LoraConfig`` from Axolotl's fields (``lora_r``, ``lora_alpha``, ``lora_dropout``,
    ``lora_target_modules``, ``lora_target_linear``, ``peft_use_rslora``, ``lora_modules_to_save``,
    ``lora_target_parameters``). As in Axolotl, ``target_linear`` adds every linear layer except the
    output head to ``target_modules``; neither: PEFT's default targets. A string is a regular
    expression over whole module names. ``modules_to_save``: modules trained in full beside the
    adapters (e.g. ``[embed_tokens, lm_head]``); ``target_parameters``: parameters given LoRA
    directly (e.g. MoE experts' 3-D ``experts.gate_up_proj``: PEFT's ``ParamWrapper``); ``revision``:
    the base model's Hub revision (``revision_of_model``), recorded in the saved adapter's config."""
    peft = require_peft()
    if isinstance(target_modules, str) and not set(target_modules) & set("[]()*+?|\\^$"):
        target_modules = [target_modules]  # one module name, not a pattern
    if isinstance(target_modules, str) and target_linear:
        raise ValueError(
            f"lora_target_modules is a regular expression ({target_modules!r}) and lora_target_linear "
            "is true: keep one (PEFT matches either a pattern or a list of names)"
        )
    targets: Any = target_modules if isinstance(target_modules, str) else list(target_modules or [])
    if target_linear:
        targets = ALL_LINEAR if not targets else [ALL_LINEAR, *targets]
    alpha = int(alpha) if float(alpha).is_integer() else alpha
    extra = {
        k: list(v)
        for k, v in (("modules_to_save", modules_to_save), ("target_parameters", target_parameters))
        if v
    }
    return peft.LoraConfig(
        r=r,
        lora_alpha=alpha,
        lora_dropout=dropout,
        task_type="CAUSAL_LM",
        target_modules=targets or None,
        use_rslora=use_rslora,
        revision=revision,
        **extra,
    )


def is_adapter_config(obj: Any) -> bool:
    """A PEFT config object (``LoraConfig`` ...), recognised without importing peft."""
    return any(
        c.__name__ == "PeftConfigMixin" and c.__module__.startswith("peft.") for c in type(obj).__mro__
    )


def is_peft_model(model: Any) -> bool:
    """A ``PeftModel`` (what ``get_peft_model`` returns)."""
    return hasattr(model, "peft_config") and callable(getattr(model, "get_base_model", None))


def base_model_of(model: nn.Module) -> nn.Module:
    """The Hugging Face model inside a ``PeftModel`` (LoRA layers injected in place), else ``model``."""
    return model.get_base_model() if is_peft_model(model) else model


def is_lora_layer(module: nn.Module) -> bool:
    """A PEFT LoRA layer wrapping a base layer (duck-typed: no peft import)."""
    return (
        isinstance(getattr(module, "base_layer", None), nn.Module)
        and isinstance(getattr(module, "lora_A", None), nn.ModuleDict)
        and isinstance(getattr(module, "lora_B", None), nn.ModuleDict)
    )


def is_adapter_param(name: str) -> bool:
    """Whether a parameter name belongs to a LoRA adapter (not to the base model)."""
    return ".lora_" in name


SAVED_COPY = f".modules_to_save.{ADAPTER_NAME}."
"""PEFT's ``ModulesToSaveWrapper`` holds the trained copy of a ``modules_to_save`` module here
(``embed_tokens.modules_to_save.default.weight``) beside the frozen ``original_module``."""
_WRAPPER_PARTS = re.compile(r"\.(base_layer|original_module|modules_to_save\.[^.]+)(?=\.)")


def is_saved_module_param(name: str) -> bool:
    """A trained copy of a ``modules_to_save`` module's parameter (starts as the base weight)."""
    return SAVED_COPY in name


def is_trained_state(name: str) -> bool:
    """What a saved adapter holds: LoRA factors and the trained ``modules_to_save`` copies."""
    return is_adapter_param(name) or is_saved_module_param(name)


def is_frozen_original(name: str) -> bool:
    """The frozen original of a ``modules_to_save`` module (superseded by its trained copy)."""
    return ".original_module." in name


def trained_module(module: nn.Module | None) -> nn.Module | None:
    """The module that runs: a ``modules_to_save`` wrapper's trained copy, else ``module``."""
    saved = getattr(module, "modules_to_save", None) if hasattr(module, "original_module") else None
    return saved[ADAPTER_NAME] if isinstance(saved, nn.ModuleDict) and ADAPTER_NAME in saved else module


def checkpoint_key(name: str) -> str:
    """The base model's own name for a (possibly LoRA-wrapped) parameter: drops every
    ``.base_layer`` (nested for parameters with several LoRA'd tensors, PEFT's ``ParamWrapper``),
    and a ``modules_to_save`` wrapper's ``.original_module`` / ``.modules_to_save.default``."""
    return _WRAPPER_PARTS.sub("", name)


def linear_module_names(model: nn.Module) -> set[str]:
    """Leaf names of every ``nn.Linear`` but the output head: what PEFT's ``all-linear`` targets."""
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    return {
        name.rsplit(".", 1)[-1]
        for name, m in model.named_modules()
        if isinstance(m, nn.Linear) and m is not head
    }


def check_adapter_config(config: Any) -> None:
    """Refuse what ndparallel does not train correctly on every layout, naming the field."""
    if str(getattr(config, "peft_type", "")).rsplit(".", 1)[-1].upper() != "LORA":
        raise ValueError(f"adapter: only LoRA is supported, got {getattr(config, 'peft_type', config)!r}")
    for field, ok in (
        ("use_dora", False),
        ("layer_replication", None),
        ("fan_in_fan_out", False),
        ("lora_bias", False),
        ("trainable_token_indices", None),
    ):
        if getattr(config, field, ok) not in (ok, [], {}):
            raise ValueError(
                f"LoraConfig.{field}={getattr(config, field)!r} is not supported by "
                f"ndparallel: leave it at {ok!r} (plain LoRA on linear layers)"
            )


def apply_adapter(model: nn.Module, config: Any) -> nn.Module:
    """Wrap ``model`` with PEFT (``get_peft_model``): the base weights frozen, LoRA A/B trainable in
    fp32 (PEFT's ``autocast_adapter_dtype``). ``all-linear`` inside a target list is expanded
    (Axolotl's ``lora_target_linear`` together with ``lora_target_modules``); on a mixture-of-experts
    model always, so that it means the ``nn.Linear`` layers there too (PEFT's own expansion would
    also put LoRA on the fused 3-D expert weights and the routers, ``target_parameters``)."""
    import copy

    peft = require_peft()
    check_adapter_config(config)
    if config.target_parameters and config.lora_dropout:
        raise ValueError(
            f"lora_target_parameters with lora_dropout={config.lora_dropout:g}: LoRA on a parameter "
            "has no input to drop out (PEFT's ParamWrapper): set lora_dropout: 0"
        )
    targets = config.target_modules
    if isinstance(targets, str) and targets == ALL_LINEAR and experts_modules(model):
        targets = [ALL_LINEAR]
    if isinstance(targets, (list, set, tuple)) and ALL_LINEAR in targets:
        config = copy.deepcopy(config)
        config.target_modules = sorted((set(targets) - {ALL_LINEAR}) | linear_module_names(model))
    asked = sorted(config.target_modules or []) if not isinstance(config.target_modules, str) else [targets]
    wanted = set(config.target_parameters or [])
    if (
        config.modules_to_save
        and tied_embeddings(model)
        and not getattr(config, "ensure_weight_tying", False)
    ):
        config = copy.deepcopy(config)  # the trained embedding stays the LM head, as in the base
        config.ensure_weight_tying = True
    try:
        wrapped = peft.get_peft_model(model, config, adapter_name=ADAPTER_NAME, autocast_adapter_dtype=True)
    except ValueError as e:  # PEFT mapped transformers-4 names onto fused experts, then refused a setting
        if "ParamWrapper" not in str(e) or wanted:
            raise
        raise ValueError(
            f"LoRA targets {asked} reach the fused expert weights of this mixture-of-experts model "
            f"(PEFT maps them to target_parameters: {e}): name the experts in "
            "lora_target_parameters (with lora_dropout: 0), or target the attention and dense "
            "linears only"
        ) from None
    fused = set(getattr(adapter_config_of(wrapped), "target_parameters", None) or []) - wanted
    if fused:  # PEFT maps transformers-4 names (gate_proj, up_proj, w1 ...) onto fused MoE weights
        raise ValueError(
            f"LoRA targets {asked} reach the fused expert weights / "
            f"routers of this mixture-of-experts model ({sorted(fused)}, PEFT target_parameters): "
            "name them in lora_target_parameters (e.g. [experts.gate_up_proj, experts.down_proj]) "
            "to adapt them, or target the attention and dense linears (lora_target_modules: "
            "[q_proj, k_proj, v_proj, o_proj], or lora_target_linear: true)"
        )
    _upcast_saved_modules(wrapped)
    reached = {
        checkpoint_key(f"{n}.{m.parameter_name}") for n, m in wrapped.named_modules() if is_param_wrapper(m)
    }
    unmatched = sorted(w for w in wanted if not any(r == w or r.endswith(f".{w}") for r in reached))
    if unmatched:  # PEFT passes over them silently
        raise ValueError(
            f"lora_target_parameters {unmatched} match no parameter of {type(model).__name__} "
            "(name them as module.parameter, e.g. experts.gate_up_proj for a mixture-of-experts "
            "layer's fused 3-D weights; a dense model has none)"
        )
    return wrapped


@torch.no_grad()
def _upcast_saved_modules(model: nn.Module) -> None:
    """The trained ``modules_to_save`` copies in fp32 (as PEFT's ``autocast_adapter_dtype`` keeps
    the adapters): fp32 master weights while the frozen original keeps the base's dtype."""
    for name, p in model.named_parameters():
        if is_saved_module_param(name) and p.dtype in (torch.float16, torch.bfloat16):
            torch.utils.swap_tensors(p, nn.Parameter(p.detach().float(), requires_grad=p.requires_grad))


def tied_embeddings(model: nn.Module) -> bool:
    """Whether the model's LM head is its input embedding (``tie_word_embeddings``)."""
    get_in, get_out = (
        getattr(model, "get_input_embeddings", None),
        getattr(model, "get_output_embeddings", None),
    )
    emb, head = (get_in() if callable(get_in) else None), (get_out() if callable(get_out) else None)
    return emb is not None and head is not None and getattr(emb, "weight", None) is getattr(head, "weight", 0)


def adapter_config_of(model: nn.Module):
    """The ``LoraConfig`` of a PEFT model's (only) adapter."""
    return model.peft_config[ADAPTER_NAME]


WHOLE_TRAINED = "whole_trained_shapes"
"""The attribute a part of a model (a pipeline stage view) records the whole model's
``trained_shapes`` under, taken before the cut: adapter files and the seeded init are the whole's."""


def trained_shapes(model: nn.Module) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """(name, full shape, dtype) of every trained tensor of a PEFT model (LoRA factors,
    ``modules_to_save`` copies; tied copies under each name), in parameter order — of the whole
    model even where ``model`` holds a part of it (``WHOLE_TRAINED``)."""
    whole = getattr(model, WHOLE_TRAINED, None)
    if whole is not None:
        return list(whole)
    return [
        (n, tuple(p.shape), p.dtype)
        for n, p in model.named_parameters(remove_duplicate=False)
        if is_trained_state(n)
    ]


@torch.no_grad()
def initial_adapter_weights(model: nn.Module, seed: int) -> dict[str, torch.Tensor]:
    """Full initial LoRA weights of a PEFT model whose adapters hold no data yet (built on the meta
    device): A as PEFT initialises it (Kaiming-uniform, or normal(0, 1/r) for ``"gaussian"``), B
    zero, so the model starts equal to the base. Drawn from ``seed`` in the whole model's parameter
    order (``trained_shapes``): the same on every rank, every layout and every pipeline stage."""
    init = adapter_config_of(model).init_lora_weights
    if init not in (True, "gaussian"):
        raise ValueError(
            f"LoraConfig.init_lora_weights={init!r}: loading a model from disk supports "
            "True (PEFT's default) and 'gaussian'"
        )
    g = torch.Generator().manual_seed(seed)
    own = {n for n, _ in model.named_parameters()}
    out = {}
    for name, shape, dtype in trained_shapes(model):
        if not is_adapter_param(name):
            continue
        full = torch.zeros(shape, dtype=dtype)
        if ".lora_A." in name:
            if init == "gaussian":
                full.normal_(0.0, 1.0 / adapter_config_of(model).r, generator=g)
            else:
                nn.init.kaiming_uniform_(full, a=math.sqrt(5), generator=g)
        if name in own:
            out[name] = full
    return out


class MergeSpec(NamedTuple):
    """How one base weight and its adapter merge: ``W + scaling · B @ A`` (``experts`` 0: a linear's
    2-D weight), or per expert for a 3-D weight adapted through ``target_parameters`` (PEFT's
    ``ParamWrapper``: ``experts`` experts, ``layout`` the einsum giving the weight's own layout)."""

    a: str
    b: str
    scaling: float
    experts: int = 0
    layout: str = ""


def is_param_wrapper(module: nn.Module) -> bool:
    """A PEFT ``ParamWrapper``: LoRA on a parameter (``target_parameters``) instead of a linear."""
    return isinstance(getattr(module, "parameter_name", None), str) and is_lora_layer(module)


def merge_specs(model: nn.Module) -> dict[str, MergeSpec]:
    """For every LoRA-adapted weight of the Hugging Face model ``model`` (linears and
    ``target_parameters``): its name -> its ``MergeSpec``."""
    out = {}
    names = {id(m): n for n, m in model.named_modules()}
    for prefix, m in model.named_modules():
        if not (is_lora_layer(m) and ADAPTER_NAME in m.lora_A):
            continue
        a, b = f"{prefix}.lora_A.{ADAPTER_NAME}.weight", f"{prefix}.lora_B.{ADAPTER_NAME}.weight"
        scaling = float(m.scaling[ADAPTER_NAME])
        if not is_param_wrapper(m):
            out[f"{prefix}.base_layer.weight"] = MergeSpec(a, b, scaling)
            continue
        name = f"{names[id(m.get_base_layer())]}.{m.parameter_name}"
        if m.num_experts == 1:
            out[name] = MergeSpec(a, b, scaling)
        else:  # as PEFT's ParamWrapper.get_delta_weight
            layout = "o r e, e r i -> e o i" if m._did_swap_in_out_features else "o r e, e r i -> e i o"
            out[name] = MergeSpec(a, b, scaling, m.num_experts, layout)
    return out


def merged_weight(weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, spec: MergeSpec) -> torch.Tensor:
    """``weight`` with its adapter merged in (in fp32, returned in ``weight``'s dtype)."""
    a, b = a.float(), b.float()
    if not spec.experts:
        delta = b @ a
    else:
        delta = torch.einsum(
            spec.layout, b.reshape(b.shape[0], -1, spec.experts), a.reshape(spec.experts, -1, a.shape[-1])
        )
    return (weight.float() + spec.scaling * delta).to(weight.dtype)


def peft_save_key(name: str) -> str:
    """The key PEFT's ``save_pretrained`` stores an adapter tensor under (the adapter name
    dropped: ``...q_proj.lora_A.default.weight`` -> ``...q_proj.lora_A.weight``)."""
    return (
        name.replace(f".lora_A.{ADAPTER_NAME}.", ".lora_A.")
        .replace(f".lora_B.{ADAPTER_NAME}.", ".lora_B.")
        .replace(SAVED_COPY, ".")
    )
