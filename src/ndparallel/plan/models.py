"""Model shapes the planner needs: built-in presets (as data) and loading an HF ``config.json``.

Decoder-only models of the Llama family shape: token embedding, ``L`` decoder layers (RMSNorm, GQA
attention with q/k/v/o projections, RMSNorm, gated MLP), final norm and LM head (optionally tied
to the embedding). Qwen3 adds per-head q/k RMSNorms. Mixture-of-experts models (Qwen3-MoE,
Mixtral, Qwen2-MoE, OLMoE, gpt-oss shapes) replace every layer's MLP by a router and E experts
(optionally shared experts): ``plan/moe_cost.py``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from functools import cached_property, lru_cache
from pathlib import Path

from ndparallel.models.moe_config import config_num_experts
from ndparallel.models.presets import PRESETS as BUILTIN
from ndparallel.models.presets import PUBLISHED
from ndparallel.plan.field_hash import cached_field_hash
from ndparallel.plan.moe_cost import active_matmul_params_per_layer, expert_params


@dataclass(frozen=True)
class ParamSpec:
    """One parameter tensor: full shape, the dim TP shards (None: replicated over tp), its FSDP unit
    and how many such tensors the model has (``count`` = number of layers for layer parameters)."""

    name: str
    shape: tuple[int, ...]
    tp_dim: int | None
    unit: str
    count: int = 1

    @cached_property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True)
class ModelSpec:
    """Shape of a dense decoder-only causal LM (the numbers of its HF config)."""

    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    head_dim_: int | None = None
    tied_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False
    hf_id: str | None = field(default=None, compare=False)
    num_experts: int = 0
    """Experts per layer (0: a dense model; then every MoE field is 0)."""
    top_k: int = 0
    """Experts a token uses."""
    moe_intermediate: int = 0
    """Width of one expert's gated MLP."""
    shared_intermediate: int = 0
    """Width of the shared experts' MLP every token also runs (Qwen2-MoE); 0: none."""
    has_embedding: bool = True
    """False for a pipeline rank without the first stage (``plan/pipeline/schedule_model.py: rank_model``)."""
    has_lm_head: bool = True
    """False for a pipeline rank without the last stage: no final norm, LM head or loss."""

    def __hash__(self) -> int:
        return cached_field_hash(self)

    @property
    def head_dim(self) -> int:
        return self.head_dim_ or self.hidden // self.heads

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    # ------------------------------------------------------------- parameters
    def param_specs(self) -> list[ParamSpec]:
        """Every parameter tensor with its TP sharding and FSDP unit (``_param_specs``, cached:
        the search asks for them thousands of times)."""
        return list(_param_specs(self))

    def _specs(self) -> list[ParamSpec]:
        """Every parameter tensor with its TP sharding and FSDP unit (see ``fsdp_units``).

        TP plan (Llama/Qwen ``base_model_tp_plan`` plus vocab-parallel embedding and LM head):
        q/k/v/gate/up colwise (weight dim 0), o/down rowwise (weight dim 1), embedding and LM head
        sharded on the vocab dim (0), norms replicated over tp.
        """
        h, d, L = self.hidden, self.head_dim, self.layers
        q, kv, f = self.heads * d, self.kv_heads * d, self.intermediate
        head_unit = "root" if self.tied_embeddings else "final"
        embed_unit = "root" if self.tied_embeddings else "embed"
        specs = (
            [ParamSpec("embed_tokens.weight", (self.vocab, h), 0, embed_unit)] if self.has_embedding else []
        )
        layer = [
            ParamSpec("input_layernorm.weight", (h,), None, "layer", L),
            ParamSpec("self_attn.q_proj.weight", (q, h), 0, "layer", L),
            ParamSpec("self_attn.k_proj.weight", (kv, h), 0, "layer", L),
            ParamSpec("self_attn.v_proj.weight", (kv, h), 0, "layer", L),
        ]
        if self.attention_bias:
            layer += [
                ParamSpec("self_attn.q_proj.bias", (q,), 0, "layer", L),
                ParamSpec("self_attn.k_proj.bias", (kv,), 0, "layer", L),
                ParamSpec("self_attn.v_proj.bias", (kv,), 0, "layer", L),
            ]
        if self.qk_norm:
            layer += [
                ParamSpec("self_attn.q_norm.weight", (d,), None, "layer", L),
                ParamSpec("self_attn.k_norm.weight", (d,), None, "layer", L),
            ]
        layer += [
            ParamSpec("self_attn.o_proj.weight", (h, q), 1, "layer", L),
            ParamSpec("post_attention_layernorm.weight", (h,), None, "layer", L),
        ]
        if f:
            layer += [
                ParamSpec("mlp.gate_proj.weight", (f, h), 0, "layer", L),
                ParamSpec("mlp.up_proj.weight", (f, h), 0, "layer", L),
                ParamSpec("mlp.down_proj.weight", (h, f), 1, "layer", L),
            ]
        if self.is_moe:  # not tensor-parallel: router and shared MLP replicated over tp
            e, i, sh = self.num_experts, self.moe_intermediate, self.shared_intermediate
            layer += [
                ParamSpec("mlp.gate.weight", (e, h), None, "layer", L),
                ParamSpec("mlp.experts.gate_up_proj", (e, 2 * i, h), None, "experts", L),
                ParamSpec("mlp.experts.down_proj", (e, h, i), None, "experts", L),
            ]
            if sh:
                layer += [
                    ParamSpec("mlp.shared_expert.gate_proj.weight", (sh, h), None, "layer", L),
                    ParamSpec("mlp.shared_expert.up_proj.weight", (sh, h), None, "layer", L),
                    ParamSpec("mlp.shared_expert.down_proj.weight", (h, sh), None, "layer", L),
                    ParamSpec("mlp.shared_expert_gate.weight", (1, h), None, "layer", L),
                ]
        specs += [replace(p, name=f"layers.*.{p.name}") for p in layer]
        if self.has_lm_head:
            specs.append(ParamSpec("norm.weight", (h,), None, head_unit))
        if self.has_lm_head and not self.tied_embeddings:
            specs.append(ParamSpec("lm_head.weight", (self.vocab, h), 0, head_unit))
        return specs

    @property
    def num_params(self) -> int:
        return sum(p.numel * p.count for p in self.param_specs())

    @property
    def layer_params(self) -> int:
        return sum(p.numel for p in self.param_specs() if p.unit == "layer")

    @property
    def matmul_params(self) -> int:
        """Parameters used in matmuls per token (the N of 6·N·tokens): every linear and the LM head
        (which is the embedding matrix when tied); the embedding lookup and norms do no matmul. In
        an MoE model the *active* ones: the router, the shared MLP and k of the E experts."""
        linear = sum(
            p.numel * p.count
            for p in self.param_specs()
            if p.unit == "layer"
            and len(p.shape) == 2
            and ".mlp.gate." not in p.name
            and ".mlp.shared" not in p.name
        )
        if self.is_moe:
            linear += self.layers * active_matmul_params_per_layer(self)
        return linear + (self.vocab * self.hidden if self.has_lm_head else 0)

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "hidden_size": self.hidden,
            "num_hidden_layers": self.layers,
            "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.intermediate,
            "vocab_size": self.vocab,
            "tie_word_embeddings": self.tied_embeddings,
            "attention_bias": self.attention_bias,
            "qk_norm": self.qk_norm,
            "num_params": self.num_params,
            **(
                {
                    "num_experts": self.num_experts,
                    "num_experts_per_tok": self.top_k,
                    "moe_intermediate_size": self.moe_intermediate,
                    "shared_expert_intermediate_size": self.shared_intermediate,
                    "active_params": self.active_params,
                }
                if self.is_moe
                else {}
            ),
        }

    @property
    def active_params(self) -> int:
        """Parameters one token uses (all of them in a dense model; k of E experts in an MoE)."""
        if not self.is_moe:
            return self.num_params

        per_token = self.top_k * 3 * self.hidden * self.moe_intermediate
        return self.num_params - self.layers * (expert_params(self) - per_token)


@lru_cache(maxsize=256)
def _param_specs(model: ModelSpec) -> tuple[ParamSpec, ...]:
    return tuple(model._specs())


def fsdp_units(model: ModelSpec) -> dict[str, tuple[int, bool]]:
    """FSDP unit name -> (how many such units, resharded after forward?).

    One unit per decoder layer and one for the embedding (resharded after forward when
    ``reshard_after_forward``); norm + LM head form the last unit, kept unsharded after forward
    because backward needs it at once (FSDP2 keeps the root unsharded too). Tied embeddings share
    one tensor, so embedding, norm and LM head all live in the root unit.
    """
    units = {"layer": (model.layers, True)}
    if model.is_moe:  # each layer's experts: their own unit, sharded over efsdp (plan/moe_cost.py)
        units["experts"] = (model.layers, True)
    if model.tied_embeddings:
        units["root"] = (1, False)
        return units
    if model.has_embedding:
        units["embed"] = (1, True)
    if model.has_lm_head:
        units["final"] = (1, False)
    return units


def from_hf_config(cfg: dict, name: str = "custom") -> ModelSpec:
    """ModelSpec from the dict of an HF ``config.json`` (Llama/Qwen/Mistral field names; the MoE
    fields of Qwen3-MoE / Qwen2-MoE / Mixtral / OLMoE / gpt-oss). A multimodal config (Gemma 3 / 4,
    Mistral 3, Voxtral, Qwen 3.5): its ``text_config`` (the towers, frozen and never run on text, are
    left out: an undercount of their parameters, e.g. ~0.4 B for a SigLIP / Pixtral tower)."""
    if isinstance(cfg.get("text_config"), dict) and "num_hidden_layers" not in cfg:
        cfg = {"tie_word_embeddings": cfg.get("tie_word_embeddings", False), **cfg["text_config"]}
    missing = [
        k
        for k in (
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "intermediate_size",
            "vocab_size",
        )
        if k not in cfg
    ]
    if missing:
        raise ValueError(f"{name}: config.json lacks {', '.join(missing)}")
    heads = int(cfg["num_attention_heads"])
    fields = dict(
        name=name,
        hidden=int(cfg["hidden_size"]),
        layers=int(cfg["num_hidden_layers"]),
        heads=heads,
        kv_heads=int(cfg.get("num_key_value_heads") or heads),
        intermediate=int(cfg["intermediate_size"]),
        vocab=int(cfg["vocab_size"]),
        head_dim_=cfg.get("head_dim") or None,
        tied_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=bool(cfg.get("attention_bias", False)),
        qk_norm=str(cfg.get("model_type", "")).startswith("qwen3"),
        hf_id=name,
    )
    return ModelSpec(**{**fields, **_moe_fields(cfg, name)})


def _moe_fields(cfg: dict, name: str) -> dict:
    """The MoE fields of an HF config dict (empty for a dense model); refuses what is not modelled."""

    experts = config_num_experts(cfg)
    if experts is None:
        return {}
    if cfg.get("kv_lora_rank") or cfg.get("first_k_dense_replace"):
        raise ValueError(
            f"{name}: DeepSeek-style MoE (multi-head latent attention, dense first layers) is "
            "not modelled by the planner"
        )
    if (cfg.get("decoder_sparse_step") or 1) != 1 or cfg.get("mlp_only_layers"):
        raise ValueError(
            f"{name}: MoE configs with dense layers (decoder_sparse_step, mlp_only_layers) are not "
            "modelled by the planner: it assumes every layer is an MoE layer"
        )
    width = cfg.get("moe_intermediate_size") or cfg["intermediate_size"]
    shared = cfg.get("shared_expert_intermediate_size") or 0
    return {
        "num_experts": experts,
        "top_k": int(cfg.get("num_experts_per_tok") or 1),
        "moe_intermediate": int(width),
        "shared_intermediate": int(shared),
        "intermediate": 0,
    }


def _presets() -> dict[str, ModelSpec]:
    """The planner's named models: the published shapes of ``ndparallel.models.presets`` and
    ``tiny`` (the built-in ``tiny-llama``, for CPU checks and exact byte comparisons)."""

    specs = {
        name: replace(from_hf_config(fields, name), hf_id=hub_id)
        for name, (hub_id, fields) in PUBLISHED.items()
    }
    specs["tiny"] = replace(from_hf_config(BUILTIN["tiny-llama"], "tiny"), hf_id="tiny-llama")
    return specs


PRESETS: dict[str, ModelSpec] = _presets()


def load_model_spec(model: str) -> ModelSpec:
    """A preset name or its Hub id, or a path to an HF ``config.json`` or to a directory holding one."""
    key = model.lower()
    if key in PRESETS:
        return PRESETS[key]
    by_hub_id = {(p.hf_id or "").lower(): p for p in PRESETS.values() if p.hf_id}
    path = Path(model)
    if key in by_hub_id and not path.exists():  # a preset's Hub id (a train config's base_model)
        return by_hub_id[key]
    if path.is_dir():
        path = path / "config.json"
    if path.is_file():
        with open(path) as fh:
            return from_hf_config(json.load(fh), name=model)
    raise ValueError(
        f"unknown model {model!r}: give a preset ({', '.join(PRESETS)}), its Hub id, or a path to an HF "
        "config.json or a model directory (download a Hub model's config.json first)"
    )
