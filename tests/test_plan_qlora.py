"""The planner's QLoRA model (``plan --adapter qlora``): NF4 bytes equal the runtime's NF4 tensors, the
states are the adapters' (8-bit AdamW: ~2 bytes each), layouts the runtime refuses are rejected,
and 70B QLoRA on 2 GPUs is planned and written as a train config that validates."""

from __future__ import annotations

import math

import pytest
import torch
import yaml

from ndparallel.config import TrainConfig
from ndparallel.layout.dims import ParallelDims
from ndparallel.models.nf4_config import NF4_BYTES_PER_PARAM
from ndparallel.plan.adapters.lora_cost import adapter_shard_numel
from ndparallel.plan.adapters.qlora import quantized_layer_local, quantized_shard_numel
from ndparallel.plan.cli.main import main
from ndparallel.plan.hardware import PRESETS as HW
from ndparallel.plan.memory.peak import estimate_memory
from ndparallel.plan.models import PRESETS, ModelSpec
from ndparallel.plan.settings import Settings
from ndparallel.plan.time.comms import collectives_for

pytest.importorskip("torchao")
H100 = HW["h100-80gb"]
SMALL = ModelSpec("small", hidden=256, layers=2, heads=4, kv_heads=2, intermediate=512, vocab=1024)
LLAMA70 = PRESETS["llama-3.1-70b"]


def test_nf4_bytes_equal_the_runtime_tensors():
    """One layer's NF4 tensors as torchao builds them (default blocks, on meta) hold the planner's
    0.5 + 1/64 byte per value (the per-16,384 fp32 scales and 16-entry tables: < 0.1 % more)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from ndparallel.models.quantized import NF4Config, nf4_parameter_names, quantize_linears

    cfg = LlamaConfig(
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=1024,
    )
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    quantize_linears(model, NF4Config())
    names = nf4_parameter_names(model)
    assert len(names) == 14  # every linear of both layers, not lm_head
    params = dict(model.named_parameters())
    stored = sum(
        getattr(params[n], a).numel() * getattr(params[n], a).element_size()
        for n in names
        for a in ("quantized_data", "quantized_scalers", "quantization_factor")
    )
    values = sum(params[n].numel() for n in names)
    assert values == SMALL.layers * quantized_layer_local(SMALL, 1)
    assert values * NF4_BYTES_PER_PARAM <= stored <= values * NF4_BYTES_PER_PARAM * 1.001


def test_qlora_memory_is_lora_with_an_nf4_base_and_8bit_states():
    layout = ParallelDims(dp_shard=2)
    lora = estimate_memory(SMALL, layout, Settings(sequence_len=32, lora_r=4, set_to_none=False), H100)
    s = Settings(sequence_len=32, lora_r=4, set_to_none=False, load_in_4bit=True, optimizer="adamw_8bit")
    qlora = estimate_memory(SMALL, layout, s, H100)
    q = quantized_shard_numel(SMALL, layout)
    assert q == SMALL.layers * quantized_layer_local(SMALL, 1) // 2
    assert math.isclose(qlora.params, lora.params - q * (2 - NF4_BYTES_PER_PARAM))
    adapter = adapter_shard_numel(SMALL, layout, 4)
    assert qlora.grads == lora.grads == adapter * 4
    assert math.isclose(qlora.optimizer, adapter * (2 + 8 / 256))  # 8-bit m and v + block scales
    gathers = [
        c for c in collectives_for(SMALL, layout, s) if c.what.startswith("FSDP all-gather params (layer)")
    ]
    full = [
        c
        for c in collectives_for(SMALL, layout, Settings(sequence_len=32, lora_r=4))
        if c.what.startswith("FSDP all-gather params (layer)")
    ]
    assert math.isclose(full[0].bytes - gathers[0].bytes, q / SMALL.layers * (2 - NF4_BYTES_PER_PARAM))


def test_70b_qlora_on_two_gpus_fits_and_writes_a_train_config(tmp_path, capsys):
    args = [
        "--base-model",
        "llama-3.1-70b",
        "--gpus",
        "2",
        "--gpu",
        "h100-80gb",
        "--sequence-len",
        "4096",
        "--micro-batch-size",
        "1",
    ]
    out = tmp_path / "qlora.yaml"
    assert main([*args, "--adapter", "qlora", "--optimizer", "adamw_8bit", "--write-config", str(out)]) == 0
    text = capsys.readouterr().out
    assert "base frozen in 4-bit NF4 (linears)" in text
    assert "qlora_layout" in text  # TP 2 is rejected: the runtime refuses it
    cfg = TrainConfig.model_validate(yaml.safe_load(out.read_text()))
    assert (cfg.adapter, cfg.load_in_4bit, cfg.optimizer, cfg.tensor_parallel_size) == (
        "qlora",
        True,
        "adamw_8bit",
        1,
    )
    # the bf16 base alone is 141 GB: FSDP 2 cannot hold it with LoRA; QLoRA's NF4 base (~37 GB) can
    fsdp2 = ParallelDims(dp_shard=2)
    s = Settings(sequence_len=4096, lora_r=16, activation_checkpointing=True, chunked_loss=True)
    assert estimate_memory(LLAMA70, fsdp2, s, H100).total > H100.mem_bytes
    q = estimate_memory(LLAMA70, fsdp2, Settings(**{**s.__dict__, "load_in_4bit": True}), H100)
    assert q.total < H100.mem_bytes
    assert 17 * 2**30 < q.params < 20 * 2**30  # (68.5B x 0.516 + 2.1B x 2 bytes) / 2 + adapters


def test_layouts_the_runtime_refuses_are_rejected(capsys):
    assert (
        main(
            ["--base-model", "llama-3.1-8b", "--gpus", "8", "--adapter", "qlora", "--show-rejected", "--json"]
        )
        == 0
    )
    import json

    result = json.loads(capsys.readouterr().out)
    ranked = [r["layout"] for r in result["ranked"]]
    assert ranked and all(r["tp"] == 1 for r in ranked)
    assert any(c["code"] == "qlora_layout" for r in result["rejected"] for c in r["rejections"])
