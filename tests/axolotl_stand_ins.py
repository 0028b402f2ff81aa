"""Local stand-ins for the models of Axolotl's examples: a tiny model (2 layers, hidden 64, 4 experts
where the family has experts) of each transformers family, saved with ``save_pretrained`` into a
directory, so ``--dry-run`` checks an example's config against its family without the Hub."""

from __future__ import annotations

import warnings
from pathlib import Path

import yaml

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "axolotl_examples"
SIZES = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=512,
    max_position_embeddings=8192,
    moe_intermediate_size=32,
    num_experts=4,
    num_local_experts=4,
    n_routed_experts=4,
    num_experts_per_tok=2,
    n_shared_experts=1,
    shared_expert_intermediate_size=32,
    n_embd=64,
    n_layer=2,
    n_head=4,
    d_model=64,
    n_heads=4,
    n_layers=2,
    kv_lora_rank=16,
    q_lora_rank=16,
    qk_rope_head_dim=8,
    qk_nope_head_dim=8,
    v_head_dim=16,
    first_k_dense_replace=1,
    tie_word_embeddings=False,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
    max_seq_len=8192,
    n_positions=8192,
    seq_length=8192,
    num_key_value_groups=2,
)
_LAYERED = ("layer_types", "layers_block_type", "mlp_layer_types", "hybrid_override_pattern")


def model_types() -> dict[str, str]:
    """base_model (as the examples write it) -> the transformers model_type of its stand-in."""
    return yaml.safe_load((FIXTURES / "models.yaml").read_text())


def tiny_config(model_type: str):
    """The family's config at ``SIZES`` (only the keys it has), per-layer patterns cut to 2 layers."""
    from transformers import AutoConfig

    defaults = AutoConfig.for_model(model_type).to_dict()
    kwargs = {k: v for k, v in SIZES.items() if k in defaults}
    for key in _LAYERED:
        value = defaults.get(key)
        if isinstance(value, list) and len(value) > 2:
            kwargs[key] = value[:1] + value[-1:]
        elif isinstance(value, str) and len(value) > 2:
            kwargs[key] = value[:2]
    kwargs.update(_FAMILY.get(model_type, {}))
    return AutoConfig.for_model(model_type, **kwargs)


_FAMILY = {
    "dbrx": dict(
        attn_config={"kv_n_heads": 2, "rope_theta": 10000.0},
        ffn_config={"ffn_hidden_size": 128, "moe_num_experts": 4, "moe_top_k": 2},
    ),
    "gemma3n_text": dict(
        num_kv_shared_layers=0,
        laurel_rank=8,
        hidden_size_per_layer_input=16,
        intermediate_size=[128, 128],
        activation_sparsity_pattern=[0.0, 0.0],
        layer_types=["sliding_attention", "full_attention"],
    ),
    "gemma4_text": dict(
        layer_types=["sliding_attention", "full_attention"],
        hidden_size_per_layer_input=16,
        vocab_size_per_layer_input=512,
        sliding_window=64,
    ),
    "granitemoehybrid": dict(
        mamba_n_heads=8, mamba_d_head=16, mamba_d_state=16, mamba_expand=2, layer_types=["mamba", "attention"]
    ),
    "jamba": dict(attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1),
    "lfm2": dict(layer_types=["conv", "full_attention"]),
    "nemotron_h": dict(hybrid_override_pattern="M*", layers_block_type=["mamba", "attention"]),
    "lfm2_moe": dict(num_dense_layers=1, layer_types=["conv", "full_attention"], num_experts=4),
}


MULTIMODAL = {
    "gemma3": "gemma3_text",
    "gemma4": "gemma4_text",
    "mistral3": "ministral3",
    "voxtral": "llama",
    "qwen3_5": "qwen3_5_text",
}  # multimodal model_type -> its text model's (tiny_config)
TOWER = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=2,
    head_dim=16,
    image_size=28,
    patch_size=14,
    depth=1,
    num_heads=2,
    out_hidden_size=64,
    num_mel_bins=16,
    output_proj_dims=32,
    subsampling_conv_channels=[8, 8],
)


def tiny_multimodal(model_type: str):
    """A multimodal config: the tiny text model of ``MULTIMODAL`` (or the one named after ``+``:
    ``mistral3+mistral4``) plus 1-layer vision / audio towers."""
    from transformers import AutoConfig

    model_type, _, text_type = model_type.partition("+")
    base = AutoConfig.for_model(model_type)
    kwargs = {"text_config": tiny_config(text_type or MULTIMODAL[model_type]).to_dict()}
    for name, cls in base.sub_configs.items():
        if name != "text_config":
            current = getattr(base, name)
            tower = (type(current)() if current is not None else cls()).to_dict()
            kwargs[name] = {**tower, **{k: v for k, v in TOWER.items() if k in tower}}
    tied = model_type.startswith("gemma")  # Gemma ties its LM head to the embeddings; the others do not
    return AutoConfig.for_model(model_type, tie_word_embeddings=tied, **kwargs)


def multimodal_model(model_type: str):
    """The ``*ForConditionalGeneration`` model of ``tiny_multimodal(model_type)`` (random init)."""
    import transformers

    config = tiny_multimodal(model_type)
    mapping = transformers.AutoModelForImageTextToText._model_mapping
    cls = transformers.VoxtralForConditionalGeneration if model_type == "voxtral" else mapping[type(config)]
    return cls(config)


def is_multimodal(model_type: str) -> bool:
    return model_type.partition("+")[0] in MULTIMODAL


def stand_in(root: Path, model_type: str) -> Path:
    """``root/model_type``: a tiny random model of that family (made once per ``root``)."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    path = root / model_type
    if (path / "config.json").is_file():
        return path
    hf_logging.set_verbosity_error()
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = (
            multimodal_model(model_type)
            if is_multimodal(model_type)
            else AutoModelForCausalLM.from_config(tiny_config(model_type))
        )
        model.save_pretrained(path)
    return path
