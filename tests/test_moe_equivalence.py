"""Mixture-of-experts layouts train the same model as one process (fp32, SGD): expert parallel alone
and composed with FSDP, TP (with and without sequence parallel), CP, HSDP and all of them, with the
routers' load-balancing loss in the loss (its value compared too), gradient accumulation and
activation checkpointing; LoRA on an MoE model; a negative control (tokens sent to the wrong expert
rank); a checkpoint saved under EP 2 × FSDP 2 resumed under FSDP 4; the HF export."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
import torch

import faults
from ndparallel.models.presets import preset_config
from ndparallel.parallel.options import ActivationOptions, TPOptions
from ndparallel.testing import run_on_ranks
from ndparallel.tools.agreement import assert_differs, assert_matches, model_floor, one_process_reference
from ndparallel.tools.equivalence import TrainSetup, train_under_layout

# coef 0.5: the load-balancing loss moves the routers' gradients measurably (transformers: 0.001)
QWEN = TrainSetup(
    preset_config("tiny-qwen3-moe", router_aux_loss_coef=0.5),
    steps=3,
    global_micro_batch=4,
    seq_len=32,
    max_grad_norm=1.0,
    optimizer="sgd",
    lr=0.5,
)
MIXTRAL = dataclasses.replace(QWEN, model_config=preset_config("tiny-mixtral", router_aux_loss_coef=0.5))
SP = TPOptions(sequence_parallel=True, loss_parallel=True)


def _run(setup: TrainSetup, world: int, layout: dict, **parallel_kwargs):
    setup = dataclasses.replace(setup, parallel_kwargs=parallel_kwargs)
    got = run_on_ranks(train_under_layout, world, setup, layout, timeout_s=400)[0]
    assert got.aux_losses is not None and len(got.aux_losses) == setup.steps
    return one_process_reference(setup), got


def _check(setup: TrainSetup, world: int, layout: dict, **parallel_kwargs) -> None:
    assert_matches(*_run(setup, world, layout, **parallel_kwargs))  # the router loss compared too


CASES = {
    "ep2": (QWEN, 2, {"dp_shard_size": 2, "ep_size": 2}, {}),
    "ep2_fsdp2": (MIXTRAL, 4, {"dp_shard_size": 4, "ep_size": 2}, {}),
    "ep2_tp2": (MIXTRAL, 2, {"tp_size": 2, "ep_size": 2}, {}),  # tp ranks slice their shared rows
    "hsdp2x2_ep2": (MIXTRAL, 4, {"dp_replicate_size": 2, "dp_shard_size": 2, "ep_size": 2}, {}),
    "ep2_cp2": (QWEN, 2, {"cp_size": 2, "ep_size": 2}, {}),
    "tp2_no_ep": (QWEN, 2, {"tp_size": 2}, {}),  # experts whole per rank, FSDP'd over the tp ranks
}


@pytest.mark.parametrize("case", list(CASES))
def test_moe_layout_equals_one_process(case):
    setup, world, layout, kwargs = CASES[case]
    _check(setup, world, layout, **kwargs)


_TINY = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=256,
    max_position_embeddings=512,
    tie_word_embeddings=False,
)
FAMILIES = {  # (model_type, fields, world, layout)
    # shared experts (a dense MLP + gate in the MoE block, replicated over tp)
    "qwen2_moe": (
        "qwen2_moe",
        dict(
            intermediate_size=128,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
            num_experts=4,
            num_experts_per_tok=2,
            output_router_logits=True,
            router_aux_loss_coef=0.5,
        ),
        2,
        {"tp_size": 2, "ep_size": 2},
    ),
    # transposed expert weights with biases and its own gate activation
    "gpt_oss": (
        "gpt_oss",
        dict(
            intermediate_size=32,
            num_local_experts=4,
            num_experts_per_tok=2,
            head_dim=16,
            sliding_window=16,
            output_router_logits=True,
            router_aux_loss_coef=0.5,
        ),
        2,
        {"dp_shard_size": 2, "ep_size": 2},
    ),
    # no load-balancing loss; a dense first layer; MLA attention; a router buffer under TP
    "deepseek_v3": (
        "deepseek_v3",
        dict(
            intermediate_size=128,
            moe_intermediate_size=32,
            n_routed_experts=4,
            num_experts_per_tok=2,
            n_shared_experts=1,
            first_k_dense_replace=1,
            kv_lora_rank=16,
            q_lora_rank=None,
            qk_rope_head_dim=8,
            qk_nope_head_dim=8,
            v_head_dim=16,
            n_group=1,
            topk_group=1,
        ),
        2,
        {"tp_size": 2, "ep_size": 2},
    ),
}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_other_moe_families(family):
    from transformers import AutoConfig

    model_type, fields, world, layout = FAMILIES[family]
    setup = dataclasses.replace(
        QWEN, model_config=AutoConfig.for_model(model_type, **_TINY, **fields), steps=2
    )
    got = run_on_ranks(train_under_layout, world, setup, layout, timeout_s=400)[0]
    assert_matches(one_process_reference(setup), got)
    assert (got.aux_losses is None) == (family == "deepseek_v3")


def test_gpt_oss_under_tp_is_refused_before_sharding():
    from transformers import AutoConfig

    from ndparallel.parallel.support import layout_problem

    _, fields, _, _ = FAMILIES["gpt_oss"]
    with torch.device("meta"):
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_config(AutoConfig.for_model("gpt_oss", **_TINY, **fields))
    assert layout_problem(model, tp_size=2, probe_attention=False).startswith("tensor_parallel_size=2")
    assert layout_problem(model, ep_size=2, probe_attention=False) is None  # EP alone runs (tested above)


def test_ep_with_accumulation_and_checkpointing():
    setup = dataclasses.replace(QWEN, grad_accum=2)
    _check(
        setup,
        2,
        {"dp_shard_size": 2, "ep_size": 2},
        activation_options=ActivationOptions(activation_checkpointing=True),
    )


def test_tokens_sent_to_the_wrong_expert_rank_fail_the_check(monkeypatch):
    faults.wrong_expert_rank(monkeypatch)
    assert_differs(*_run(QWEN, 2, {"dp_shard_size": 2, "ep_size": 2}))


def test_lora_on_moe_equals_one_process():
    """LoRA on the attention linears; EP 2 × TP 2 (sequence parallel) × FSDP 2."""
    setup = dataclasses.replace(QWEN, adapter=dict(r=4, alpha=8, target_linear=True))
    _check(setup, 4, {"dp_shard_size": 2, "tp_size": 2, "ep_size": 2}, tp_options=SP)


@pytest.mark.slow
def test_fsdp_cp_tp_ep4_8_ranks():
    _check(QWEN, 8, {"dp_shard_size": 2, "cp_size": 2, "tp_size": 2, "ep_size": 4}, tp_options=SP)


# ------------------------------------------------------------------ checkpoints and export
sys.path.insert(0, str(Path(__file__).parent / "scripts"))
import ckpt_train  # noqa: E402


def test_checkpoint_of_ep2_fsdp2_resumes_under_fsdp4(tmp_path):
    """Saved at step 2 of a 3-step EP 2 × FSDP 2 run (experts split over 2, each FSDP-sharded over 2;
    the dense layers over 4); step 3 resumed under FSDP 4 equals that run's step 3."""
    ep = {"dp_shard_size": 4, "ep_size": 2}
    ref = run_on_ranks(
        ckpt_train.train, 4, ep, str(tmp_path / "run"), steps=3, save_every=2, model_preset="tiny-qwen3-moe"
    )[0]
    from ndparallel.checkpoint import list_checkpoints

    assert [step for step, _ in list_checkpoints(tmp_path / "run")] == [2]
    res = run_on_ranks(
        ckpt_train.train,
        4,
        {"dp_shard_size": 4},
        str(tmp_path / "run"),
        steps=3,
        resume=True,
        model_preset="tiny-qwen3-moe",
    )[0]
    assert list(res["losses"]) == [3]
    # two layouts, not one process, and no second way: the rule's fp32 floor over the 3 steps
    assert (
        abs(res["losses"][3] - ref["losses"][3])
        <= model_floor(preset_config("tiny-qwen3-moe"), 3) * ref["losses"][3]
    )


def test_published_layout_checkpoint_loads_under_ep(tmp_path):
    """A model saved by transformers (one tensor per expert on disk) read straight into EP 4 × TP 2 ×
    FSDP 2 shards (transformers' key conversion on the sharded load) trains as one process does."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(QWEN.model_config).save_pretrained(tmp_path / "saved")
    setup = dataclasses.replace(QWEN, model_dir=str(tmp_path / "saved"), steps=2)
    _check(setup, 4, {"dp_shard_size": 2, "tp_size": 2, "ep_size": 4})


def _export(out: str) -> None:
    from ndparallel import ParallelismConfig
    from ndparallel.checkpoint.export import save_hf_model
    from ndparallel.engine import Engine

    engine = Engine(ParallelismConfig(tp_size=2, ep_size=2))
    save_hf_model(engine.build_model("tiny-mixtral", seed=3), out, engine.is_main_process)


def test_export_writes_what_save_pretrained_writes(tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    run_on_ranks(_export, 2, str(tmp_path / "ours"))
    torch.manual_seed(3)
    AutoModelForCausalLM.from_config(preset_config("tiny-mixtral")).save_pretrained(tmp_path / "hf")
    ours, hf = (
        load_file(tmp_path / "ours" / "model.safetensors"),
        load_file(tmp_path / "hf" / "model.safetensors"),
    )
    assert "model.layers.0.block_sparse_moe.experts.3.w2.weight" in hf  # the published per-expert keys
    assert set(ours) == set(hf) and all(torch.equal(ours[k], hf[k]) for k in hf)
