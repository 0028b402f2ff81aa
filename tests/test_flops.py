"""One FLOP definition (``models.flops``): the MFU the trainer logs and the planner's use the same
count for the same model, full fine-tuning and LoRA."""

import pytest
from transformers import AutoModelForCausalLM

from ndparallel.models.flops import matmul_params, train_flops_per_token
from ndparallel.models.presets import preset_config
from ndparallel.plan.models import from_hf_config
from ndparallel.plan.time.compute import model_flops_per_token as planned
from ndparallel.training.metrics import model_flops_per_token as logged

SEQ = 256


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-llama-tied", "tiny-qwen3"])
def test_trainer_and_planner_count_the_same_flops(preset):
    config = preset_config(preset)
    model = AutoModelForCausalLM.from_config(config)
    spec = from_hf_config(config.to_dict(), preset)
    assert logged(model, config, SEQ) == planned(spec, SEQ)
    n, trained = matmul_params(model)
    assert n == trained == spec.matmul_params  # every linear, the LM head once when tied


def test_lora_counts_weight_gradients_of_the_adapters_only():
    from ndparallel.models.adapters import apply_adapter, lora_config

    config = preset_config("tiny-llama")
    model = apply_adapter(AutoModelForCausalLM.from_config(config), lora_config(r=4, target_linear=True))
    spec = from_hf_config(config.to_dict(), "tiny-llama")
    assert logged(model, config, SEQ) == planned(spec, SEQ, lora_r=4)
    n, trained = matmul_params(model)
    assert n == spec.matmul_params and 0 < trained < n // 10


def test_causal_attention_is_counted_as_it_runs():
    """QKᵀ and PV over half the score matrix: 6·L·a·d·s per token, forward and backward."""
    assert train_flops_per_token(0, 0, layers=2, attention_dim=64, seq_len=128) == 6 * 2 * 64 * 128
    assert train_flops_per_token(10, 10, 1, 1, 0) == 60  # 6·N for full fine-tuning
