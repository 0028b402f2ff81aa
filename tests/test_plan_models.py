"""Planner model specs: preset parameter counts and loading HF config.json files."""

import dataclasses
import json

import pytest
import torch
import transformers

from ndparallel.plan.models import PRESETS, from_hf_config, load_model_spec

# Published parameter counts (model cards / safetensors index totals).
KNOWN = {
    "llama-3.2-1b": 1_235_814_400,
    "llama-3.2-3b": 3_212_749_824,
    "llama-3.1-8b": 8_030_261_248,
    "llama-3.1-70b": 70_553_706_496,
    "qwen3-8b": 8_190_735_360,
    "mistral-7b": 7_248_023_552,
}


@pytest.mark.parametrize("name", sorted(KNOWN))
def test_preset_param_counts(name):
    assert PRESETS[name].num_params == KNOWN[name]


def test_large_presets_in_range():
    assert 405.0e9 < PRESETS["llama-3.1-405b"].num_params < 406.5e9
    assert 32.5e9 < PRESETS["qwen3-32b"].num_params < 33.0e9


def _count_hf(cfg) -> int:
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("kind,tied", [("llama", False), ("llama", True), ("qwen3", False)])
def test_hf_config_dir_matches_transformers(tmp_path, kind, tied):
    cls = transformers.LlamaConfig if kind == "llama" else transformers.Qwen3Config
    cfg = cls(
        hidden_size=96,
        intermediate_size=160,
        num_hidden_layers=3,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=300,
        tie_word_embeddings=tied,
    )
    cfg.save_pretrained(tmp_path)
    spec = load_model_spec(str(tmp_path))
    assert (spec.hidden, spec.layers, spec.heads, spec.kv_heads, spec.head_dim) == (96, 3, 6, 2, 16)
    assert spec.tied_embeddings is tied
    assert spec.qk_norm is (kind == "qwen3")
    assert spec.num_params == _count_hf(cfg)
    from_file = load_model_spec(str(tmp_path / "config.json"))
    assert dataclasses.replace(from_file, name=spec.name) == spec


def test_unmodelled_moe_and_unknown_rejected(tmp_path):
    dense = {
        "hidden_size": 8,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "intermediate_size": 16,
        "vocab_size": 32,
    }
    with pytest.raises(ValueError, match="DeepSeek-style"):
        from_hf_config({**dense, "n_routed_experts": 8, "kv_lora_rank": 4})
    with pytest.raises(ValueError, match="every layer is an MoE layer"):
        from_hf_config({**dense, "num_experts": 8, "mlp_only_layers": [0]})
    with pytest.raises(ValueError, match="lacks"):
        from_hf_config({"num_local_experts": 8, "hidden_size": 8})
    with pytest.raises(ValueError, match="unknown model"):
        load_model_spec("no-such-model")
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 8}))
    with pytest.raises(ValueError, match="lacks"):
        load_model_spec(str(tmp_path))
