"""Model shapes the planner needs: built-in presets (as data) and loading an HF ``config.json``.

Only dense decoder-only models of the Llama family shape are described: token embedding, ``L``
decoder layers (RMSNorm, GQA attention with q/k/v/o projections, RMSNorm, gated MLP), final norm
and LM head (optionally tied to the embedding). Qwen3 adds per-head q/k RMSNorms.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path


@dataclass(frozen=True)
class ParamSpec:
    """One parameter tensor: full shape, the dim TP shards (None: replicated over tp), its FSDP unit
    and how many such tensors the model has (``count`` = number of layers for layer parameters)."""

    name: str
    shape: tuple[int, ...]
    tp_dim: int | None
    unit: str
    count: int = 1

    @property
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

    @property
    def head_dim(self) -> int:
        return self.head_dim_ or self.hidden // self.heads

    # ------------------------------------------------------------- parameters
    def param_specs(self) -> list[ParamSpec]:
        """Every parameter tensor with its TP sharding and FSDP unit (see ``fsdp_units``).

        TP plan (Llama/Qwen ``base_model_tp_plan`` plus vocab-parallel embedding and LM head):
        q/k/v/gate/up colwise (weight dim 0), o/down rowwise (weight dim 1), embedding and LM head
        sharded on the vocab dim (0), norms replicated over tp.
        """
        h, d, L = self.hidden, self.head_dim, self.layers
        q, kv, f = self.heads * d, self.kv_heads * d, self.intermediate
        head_unit = "root" if self.tied_embeddings else "final"
        embed_unit = "root" if self.tied_embeddings else "embed"
        specs = [ParamSpec("embed_tokens.weight", (self.vocab, h), 0, embed_unit)]
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
            ParamSpec("mlp.gate_proj.weight", (f, h), 0, "layer", L),
            ParamSpec("mlp.up_proj.weight", (f, h), 0, "layer", L),
            ParamSpec("mlp.down_proj.weight", (h, f), 1, "layer", L),
        ]
        specs += [replace(p, name=f"layers.*.{p.name}") for p in layer]
        specs.append(ParamSpec("norm.weight", (h,), None, head_unit))
        if not self.tied_embeddings:
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
        """Parameters used in matmuls (the N of 6·N·tokens): every linear and the LM head (which
        is the embedding matrix when tied); the embedding lookup and norms do no matmul."""
        linear = sum(
            p.numel * p.count for p in self.param_specs() if p.unit == "layer" and len(p.shape) == 2
        )
        return linear + self.vocab * self.hidden

    def to_dict(self) -> dict:
        return {
            "name": self.name, "hidden_size": self.hidden, "num_hidden_layers": self.layers,
            "num_attention_heads": self.heads, "num_key_value_heads": self.kv_heads,
            "head_dim": self.head_dim, "intermediate_size": self.intermediate,
            "vocab_size": self.vocab, "tie_word_embeddings": self.tied_embeddings,
            "attention_bias": self.attention_bias, "qk_norm": self.qk_norm,
            "num_params": self.num_params,
        }


def fsdp_units(model: ModelSpec) -> dict[str, tuple[int, bool]]:
    """FSDP unit name -> (how many such units, resharded after forward?).

    One unit per decoder layer and one for the embedding (resharded after forward when
    ``reshard_after_forward``); norm + LM head form the last unit, kept unsharded after forward
    because backward needs it at once (FSDP2 keeps the root unsharded too). Tied embeddings share
    one tensor, so embedding, norm and LM head all live in the root unit.
    """
    units = {"layer": (model.layers, True)}
    if model.tied_embeddings:
        units["root"] = (1, False)
    else:
        units["embed"] = (1, True)
        units["final"] = (1, False)
    return units


def from_hf_config(cfg: dict, name: str = "custom") -> ModelSpec:
    """ModelSpec from the dict of an HF ``config.json`` (Llama/Qwen/Mistral field names)."""
    if cfg.get("num_experts") or cfg.get("num_local_experts") or cfg.get("n_routed_experts"):
        raise ValueError(f"{name}: mixture-of-experts configs are not supported by the planner")
    missing = [k for k in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                           "intermediate_size", "vocab_size") if k not in cfg]
    if missing:
        raise ValueError(f"{name}: config.json lacks {', '.join(missing)}")
    heads = int(cfg["num_attention_heads"])
    return ModelSpec(
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


def _presets() -> dict[str, ModelSpec]:
    """The planner's named models: the published shapes of ``ndparallel.models.presets`` and
    ``tiny`` (the built-in ``tiny-llama``, for CPU checks and exact byte comparisons)."""
    from ndparallel.models.presets import PRESETS as BUILTIN
    from ndparallel.models.presets import PUBLISHED

    specs = {name: replace(from_hf_config(fields, name), hf_id=hub_id)
             for name, (hub_id, fields) in PUBLISHED.items()}
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
