"""The model families ndparallel's test suite trains on every layout (``tests/test_family_matrix.py``:
tiny models saved by transformers' own ``save_pretrained``, FSDP 2, TP 2, CP 2, FSDP 2 × TP 2,
FSDP 2 × CP 2, TP 2 + sequence parallel, packed rows; each cell equal to one process or refused
before launch). A family outside this set gets a shrunk equivalence check of the chosen layout
before ``ndparallel train`` launches (``tools.family_check``). Keys are ``config.model_type``."""

from __future__ import annotations

TESTED_FAMILIES: dict[str, str] = {
    "llama": "Llama",
    "llama4_text": "Llama 4",
    "qwen2": "Qwen2",
    "qwen3": "Qwen3",
    "mistral": "Mistral",
    "gemma2": "Gemma 2",
    "gemma3_text": "Gemma 3",
    "gemma4_text": "Gemma 4",
    "phi3": "Phi-3",
    "olmo2": "OLMo-2",
    "cohere": "Cohere",
    "cohere2": "Cohere 2",
    "glm": "GLM",
    "glm4": "GLM-4",
    "phi": "Phi",
    "smollm3": "SmolLM3",
    "gpt_neox": "GPT-NeoX",
    "falcon": "Falcon",
    "stablelm": "StableLM",
    "qwen2_moe": "Qwen2-MoE",
    "qwen3_moe": "Qwen3-MoE",
    "mixtral": "Mixtral",
    "deepseek_v3": "DeepSeek-V3",
}
"""model_type -> the family's name in the docs."""


def is_tested_family(config) -> bool:
    """Whether ``config``'s family (its text model's ``model_type``) is in the tested set."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return getattr(text, "model_type", None) in TESTED_FAMILIES
