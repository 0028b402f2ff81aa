"""Cut an unmodified Hugging Face causal LM into pipeline stages, and name the pieces a rank holds
as the whole model names them.

A stage is the model itself with what it does not run taken out: the decoder layers of other
stages (the kept ones stay under their indices in the whole model, ``StageLayers``), the input
embeddings unless it is the first stage, the final norm and the LM head unless it is the last
(replaced by ``nn.Identity``: the model's own forward then returns the hidden states as
"logits"). Every stage therefore runs transformers' own forward — rotary embeddings, the causal /
packed-document mask from ``position_ids`` — and every strategy (TP plans, FSDP units, activation
checkpointing, compile) applies to it unchanged. ``StageView`` gives the rank's stages one module
tree under the unsplit model's names, for checkpoints, exports and the optimizer.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable

import torch.nn as nn

from ndparallel.models.adapters import WHOLE_TRAINED, base_model_of, is_peft_model
from ndparallel.models.layers import decoder_module
from ndparallel.models.moe import moe_spec
from ndparallel.models.naming import model_class_name

PIPELINE_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe")
"""Families whose decoder forward takes ``inputs_embeds`` as the hidden states unchanged and whose
logits are ``lm_head(norm(hidden))``: what a stage cut needs; each is proven by the PP
equivalence tests (Gemma scales the embeddings and soft-caps the logits inside the forward)."""


class StageLayers(nn.ModuleList):
    """A stage's decoder layers, registered under their indices in the whole model
    (``layers.4`` stays ``layers.4`` on the stage that starts at layer 4). Integer indexing and
    iteration are by position, as the decoder's forward expects of its ``ModuleList``."""

    def __init__(self, layers: dict[int, nn.Module] | Iterable[nn.Module] | None = None) -> None:
        super().__init__()
        if isinstance(layers, dict):
            for index, layer in layers.items():
                self.add_module(str(index), layer)
        elif layers is not None:  # a slice (the decoder's ``self.layers[:n]``): positions
            for position, layer in enumerate(layers):
                self.add_module(str(position), layer)

    def __getitem__(self, idx):
        if isinstance(idx, slice):
            return StageLayers(list(self._modules.values())[idx])
        return list(self._modules.values())[idx]


def pipeline_family_problem(config) -> str | None:
    """Why a model of ``config`` cannot be cut into pipeline stages exactly, or None."""
    model_type = getattr(config, "model_type", None)
    if model_type in PIPELINE_FAMILIES:
        return None
    return (
        f"pipeline parallel runs the families {list(PIPELINE_FAMILIES)}, whose stages are exact cuts of "
        f"the decoder; this model is {model_type!r}: set pipeline_parallel_size: 1 (and use dp_shard / tp)"
    )


def adapter_pipeline_problem(model: nn.Module) -> str | None:
    """Why a LoRA model cannot be cut into stages exactly, or None: a trained weight that is both
    the input embedding and the LM head (``lora_modules_to_save`` on tied embeddings) would be two
    trained copies on the first and the last stage."""
    if not is_peft_model(model):
        return None
    base = base_model_of(model)
    emb, head = base.get_input_embeddings(), base.get_output_embeddings()
    trained = {id(p) for p in emb.parameters() if p.requires_grad} if emb is not None else set()
    if head is not None and any(id(p) in trained for p in head.parameters()):
        return (
            "pipeline parallel with lora_modules_to_save on tied embeddings (one trained weight is the first "
            "stage's embedding and the last stage's LM head) is not supported: drop embed_tokens / lm_head "
            "from lora_modules_to_save, or set pipeline_parallel_size: 1"
        )
    return None


ROUTER_LOSS_UNDER_PP = (
    "pipeline parallel with a mixture-of-experts router load-balancing loss is not supported yet (its expert "
    "fractions span every stage's layers): set output_router_logits: false in overrides_of_model_config, or "
    "pipeline_parallel_size: 1"
)
RING_CP_UNDER_PP_ON_CPU = (
    "pipeline parallel with ring context parallel crashes gloo (a CPU run): set cp_comm_strategy: allgather "
    "(Python: CPOptions(comm_strategy='allgather'))"
)


def pipeline_model_problem(
    model: nn.Module, cp_enabled: bool, cp_strategy: str, device_type: str
) -> str | None:
    """Why ``model`` (with its LoRA adapter, if any) cannot be cut into pipeline stages and run on
    this device, or None: the family, the adapter, a router load-balancing loss, ring CP on gloo.
    One policy for the engine (the model in hand) and the pre-launch checks (the config's words)."""
    base = base_model_of(model)
    problem = pipeline_family_problem(getattr(base, "config", None)) or adapter_pipeline_problem(model)
    if problem:
        return problem
    spec = moe_spec(base)
    if spec is not None and spec.aux_loss_coef is not None:
        return ROUTER_LOSS_UNDER_PP
    if cp_enabled and cp_strategy == "ring" and device_type == "cpu":
        return RING_CP_UNDER_PP_ON_CPU
    return None


def cut_stage(model: nn.Module, layers: Iterable[int], first: bool, last: bool) -> nn.Module:
    """Make ``model`` (in place) the stage that runs decoder ``layers``; ``first`` keeps the input
    embeddings, ``last`` the final norm and the LM head. Returns ``model`` (a LoRA ``PeftModel``:
    the Hugging Face model inside it is cut, its LoRA layers go with their layers)."""
    model, wrapper = base_model_of(model), model
    decoder = decoder_module(model)
    if decoder is None or not isinstance(getattr(decoder, "layers", None), nn.ModuleList):
        raise ValueError(f"{type(model).__name__}: no decoder with a `layers` list found to cut into stages")
    whole = decoder.layers
    decoder.layers = StageLayers({i: whole[i] for i in layers})
    if not first:
        decoder.embed_tokens = None
    if not last:
        decoder.norm = nn.Identity()
        model.lm_head = nn.Identity()
    return wrapper


def cut_stages(
    model: nn.Module, stage_layers: dict[int, tuple[int, ...]], n_stages: int
) -> dict[int, nn.Module]:
    """One cut copy of ``model`` per stage in ``stage_layers`` (stage -> its layer indices); the
    last of them is ``model`` itself (no copy). On the meta device the copies cost nothing."""
    stages = sorted(stage_layers)
    out = {}
    for k, s in enumerate(stages):
        piece = model if k == len(stages) - 1 else copy.deepcopy(model)
        out[s] = cut_stage(piece, stage_layers[s], first=s == 0, last=s == n_stages - 1)
    return out


def _has_state(module: nn.Module) -> bool:
    return any(True for _ in module.parameters()) or any(True for _ in module.buffers())


def merge_views(modules: list[nn.Module]) -> nn.Module:
    """One module tree holding ``modules``' parameters under the names each has (stages of one
    model: their names are disjoint but for stateless stand-ins and copies of buffers such as
    rotary frequencies). Returns the single module as is."""
    if len(modules) == 1:
        return modules[0]
    if all(isinstance(m, StageLayers) for m in modules):
        merged = StageLayers()
        for m in modules:
            for name, layer in m._modules.items():
                merged.add_module(name, layer)
        return StageLayers({int(k): merged._modules[k] for k in sorted(merged._modules, key=int)})
    view = nn.Module()
    names = list(dict.fromkeys(n for m in modules for n in m._modules))
    for name in names:
        children = [m._modules[name] for m in modules if m._modules.get(name) is not None]
        stateful = [c for c in children if _has_state(c)]
        if not children:
            continue
        if len(stateful) <= 1 or all(c is stateful[0] for c in stateful):
            view.add_module(name, (stateful or children)[0])
        elif isinstance(stateful[0], StageLayers) or not any(c._parameters or c._buffers for c in stateful):
            view.add_module(name, merge_views(stateful))  # containers: the decoder, its layers
        elif not any(c._parameters for c in stateful):  # copies of the same buffers (rotary frequencies)
            view.add_module(name, stateful[0])
        else:
            raise ValueError(f"two pipeline stages of one rank both hold the parameters of {name!r}")
    return view


class StageView(nn.Module):
    """The rank's pipeline stages as one module under the unsplit model's parameter names (what
    ``state_dict``, DCP checkpoints, exports and the optimizer see). Training runs through the
    engine's pipeline (``engine.train_step``), never through this module's forward.

    Stages that are LoRA ``PeftModel``s give a view named as the whole ``PeftModel`` is
    (``base_model.model.<the model's names>``) that answers PEFT's ``peft_config`` and
    ``get_base_model()`` (the view of the Hugging Face models inside); ``whole_trained``: the whole
    model's ``trained_shapes``, taken before the cut (adapter files and the seeded init)."""

    def __init__(self, stages: dict[int, nn.Module], whole_trained: list | None = None) -> None:
        super().__init__()
        pieces = [stages[s] for s in sorted(stages)]
        if is_peft_model(pieces[0]):
            holder = nn.Module()  # PEFT's LoraModel holds the model as `model`
            holder.add_module("model", StageView({s: base_model_of(m) for s, m in stages.items()}))
            self.add_module("base_model", holder)
            self.peft_config = pieces[0].peft_config
            setattr(self, WHOLE_TRAINED, whole_trained)
        else:
            for name, child in merge_views(pieces)._modules.items():
                self.add_module(name, child)
        base = base_model_of(pieces[0])
        self.config, self.hf_class_name = base.config, model_class_name(base)
        self._tied_weights_keys = getattr(base, "_tied_weights_keys", None)  # loading a stage's own copy
        self.stage_indices = tuple(sorted(stages))
        self.pp_group = None  # set by ``attach``: the export streams every stage to the first
        self.stage_main = False

    def attach(self, pp_group, stage_main: bool) -> None:
        """The pipeline's process group and whether this rank sends its stages' tensors in an
        export (its stage's first rank); a LoRA view's base view too."""
        self.pp_group, self.stage_main = pp_group, stage_main
        if is_peft_model(self):
            self.get_base_model().attach(pp_group, stage_main)

    def get_base_model(self) -> nn.Module:
        """A LoRA view's Hugging Face model view (PEFT's ``PeftModel.get_base_model``); else itself."""
        return self.base_model.model if "base_model" in self._modules else self

    def forward(self, *args, **kwargs):
        raise RuntimeError(
            "a pipeline-parallel model holds only this rank's stages: train it with the engine's "
            "train_step (ndparallel train) or Accelerator.pipeline_step, not model(...)"
        )
