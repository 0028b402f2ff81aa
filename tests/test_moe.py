"""Mixture of experts without many ranks: the expert-parallel degrees and their errors, the routers'
load-balancing loss = transformers', YAML and pre-launch checks, LoRA targets, FLOP counts, and
the planner's MoE model (docs/moe.md)."""

from __future__ import annotations

import pytest
import torch

from ndparallel.layout.config import ParallelismConfig, ParallelismConfigError
from ndparallel.layout.dims import ParallelDims
from ndparallel.models.presets import preset_config
from ndparallel.testing import run_on_ranks


def test_ep_is_carved_out_of_dp_shard_cp_tp(monkeypatch):
    dims = ParallelDims(dp_replicate=2, dp_shard=2, cp=2, tp=2, ep=4)
    assert (dims.world, dims.efsdp, dims.expert_fsdp_dims()) == (16, 2, ("dp_replicate", "efsdp"))
    assert dims.describe() == "HSDP 2×2 + CP 2 + TP 2 + EP 4" and dims.compact() == "2x2x2x2+ep4"
    assert dims.experts_split(moe=True) and not ParallelDims(dp_shard=4).experts_split(moe=True)
    assert ParallelDims(tp=2).experts_split(moe=True)  # experts are never tensor-parallel
    with pytest.raises(
        ValueError, match=r"expert_parallel_size=3 must divide dp_shard × cp × tp = 2×1×2 = 4"
    ):
        ParallelDims(dp_shard=2, tp=2, ep=3)
    # Axolotl's convention (ep × dp_shard = world) gets the fix for ndparallel's rule
    with pytest.raises(
        ParallelismConfigError, match=r"adds no ranks.*dp_shard_size=4 with expert_parallel_size=2"
    ):
        ParallelismConfig(dp_shard_size=2, ep_size=2).resolve(4)
    with pytest.raises(ParallelismConfigError, match="ep_size=-1 is not allowed"):
        ParallelismConfig(ep_size=-1)
    monkeypatch.setenv("NDPARALLEL_EP_SIZE", "2")
    pc = ParallelismConfig(dp_shard_size=4).resolve(4)
    assert pc.dims.ep == 2 and pc.to_dict()["ep_size"] == 2 and "ep=2" in repr(pc)


def _aux_against_transformers(name: str):
    """One process: the engine's loss (chunked CE + coef · aux) and aux vs transformers' own
    ``loss`` and ``aux_loss`` with output_router_logits."""
    from transformers import AutoModelForCausalLM

    from ndparallel.engine import Engine

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(preset_config(name, router_aux_loss_coef=0.5)).float()
    ids = torch.randint(0, 256, (3, 17), generator=torch.Generator().manual_seed(1))
    ref = model(input_ids=ids[:, :-1], labels=ids[:, :-1], output_router_logits=True)
    shift = torch.cat([ids[:, 1:-1], torch.full((3, 1), -100)], dim=1)  # what HF's shift gives
    batch = {"input_ids": ids[:, :-1], "shift_labels": shift, "position_ids": torch.arange(16).expand(3, -1)}
    aux: list = []
    loss = Engine(ParallelismConfig()).forward_loss(model, batch, (shift != -100).sum(), aux_values=aux)
    return float(ref.loss), float(loss), float(ref.aux_loss), float(aux[0])


@pytest.mark.parametrize("name", ["tiny-qwen3-moe", "tiny-mixtral"])
def test_router_aux_loss_equals_transformers(name):
    hf_loss, loss, hf_aux, aux = run_on_ranks(_aux_against_transformers, 1, name)[0]
    assert abs(aux - hf_aux) <= 1e-6 * hf_aux and aux > 1.0  # E·Σ f·P ≈ k when balanced
    assert abs(loss - hf_loss) <= 1e-6 * hf_loss


def test_yaml_and_prelaunch_checks():
    from ndparallel.config import ConfigError, TrainConfig
    from ndparallel.preflight.checks import validate_layout
    from ndparallel.preflight.plan_text import describe_plan

    base = {"datasets": [{"path": "builtin:stdlib"}], "sequence_len": 64, "dp_shard_size": 4}
    cfg = TrainConfig.model_validate({**base, "base_model": "tiny-qwen3-moe", "expert_parallel_size": 2})
    pc, hf = validate_layout(cfg, 4, check_local=False)
    assert pc.ep_size == 2 and pc.dims.efsdp == 2
    assert "split over ep=2 (4 per rank" in describe_plan(cfg, pc, hf)
    # Axolotl's overrides_of_model_config reaches the checks and the model the ranks build
    from ndparallel.training.components import model_config

    tuned = TrainConfig.model_validate(
        {
            **base,
            "base_model": "tiny-mixtral",
            "expert_parallel_size": 2,
            "overrides_of_model_config": {"router_aux_loss_coef": 0.25},
        }
    )
    pc, hf = validate_layout(tuned, 4, check_local=False)
    assert "load-balancing loss × 0.25" in describe_plan(tuned, pc, hf)
    assert model_config(tuned).router_aux_loss_coef == 0.25
    with pytest.raises(ConfigError, match="not a mixture-of-experts model"):
        validate_layout(
            TrainConfig.model_validate({**base, "base_model": "tiny-llama", "ep_size": 2}),
            4,
            check_local=False,
        )
    with pytest.raises(
        ConfigError, match=r"expert_parallel_size=4 does not divide the 4 experts|does not divide"
    ):
        validate_layout(
            TrainConfig.model_validate(
                {**base, "base_model": "tiny-mixtral", "dp_shard_size": 8, "expert_parallel_size": 8}
            ),
            8,
            check_local=False,
        )


def test_lora_on_moe_targets_the_linear_layers():
    from ndparallel.models.adapters import adapter_config_of
    from ndparallel.tools.equivalence import TrainSetup, build_model

    model = build_model(TrainSetup(preset_config("tiny-qwen3-moe"), adapter=dict(r=4, target_linear=True)))
    assert set(adapter_config_of(model).target_modules) == {"q_proj", "k_proj", "v_proj", "o_proj"}
    assert not any(".experts." in n and p.requires_grad for n, p in model.named_parameters())
    with pytest.raises(ValueError, match="reach the fused expert weights"):  # v4 names PEFT would map
        build_model(
            TrainSetup(preset_config("tiny-qwen3-moe"), adapter=dict(r=4, target_modules=["down_proj"]))
        )


@pytest.mark.parametrize("name", ["tiny-qwen3-moe", "tiny-mixtral"])
def test_flops_count_active_experts(name):
    from transformers import AutoModelForCausalLM

    from ndparallel.models.flops import matmul_params
    from ndparallel.plan.models import from_hf_config

    config = preset_config(name)
    model = AutoModelForCausalLM.from_config(config)
    spec = from_hf_config(config.to_dict(), name)
    assert matmul_params(model) == (spec.matmul_params, spec.matmul_params)  # trainer's MFU = planner's
    assert spec.num_params == sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    assert spec.active_params == spec.num_params - experts + experts * config.num_experts_per_tok // (
        getattr(config, "num_experts", None) or config.num_local_experts
    )


def test_planner_moe_presets_and_layouts():
    from ndparallel.plan.cli.explain_keys import parse_layout
    from ndparallel.plan.cli.report import train_config
    from ndparallel.plan.hardware import get_preset
    from ndparallel.plan.memory.peak import estimate_memory
    from ndparallel.plan.models import PRESETS
    from ndparallel.plan.search.evaluation import plan
    from ndparallel.plan.search.layouts import structural_rejections
    from ndparallel.plan.search.request import PlanRequest
    from ndparallel.plan.settings import Settings

    small, big = PRESETS["qwen3-30b-a3b"], PRESETS["qwen3-235b-a22b"]
    assert round(small.num_params / 1e9, 1) == 30.5 and round(small.active_params / 1e9, 1) == 3.4
    assert round(big.num_params / 1e9) == 235 and round(big.active_params / 1e9) == 22
    layout, _ = parse_layout("1x8x1x1+ep8")
    assert layout == ParallelDims(dp_shard=8, ep=8)
    s = Settings(sequence_len=4096, activation_checkpointing=True)
    hw = get_preset("h100-80gb")
    # Expert weights per rank: all 128 experts sharded over 8 (FSDP) = 16 whole experts (EP 8)
    assert estimate_memory(small, layout, s, hw).params == pytest.approx(
        estimate_memory(small, ParallelDims(dp_shard=8), s, hw).params, rel=1e-3
    )
    assert [
        c for c, _ in structural_rejections(ParallelDims(dp_shard=2, ep=2), PRESETS["llama-3.1-8b"], 2, 8, s)
    ] == ["ep_dense"]
    result = plan(PlanRequest.of(big, hw, gpus=64, sequence_len=4096))
    best = result.ranked[0]
    assert best.layout.ep > 1 and best.best.fits  # 235B-A22B on 64: expert parallel wins
    assert train_config(best.best, result)["expert_parallel_size"] == best.layout.ep
    ranked_eps = {r.layout.ep for r in plan(PlanRequest.of(small, hw, gpus=8, sequence_len=4096)).ranked}
    assert {1, 2, 4, 8} <= ranked_eps  # 30B-A3B on 8: every EP degree fits and is ranked


def test_planner_all_to_all_bytes():
    from ndparallel.plan.models import PRESETS
    from ndparallel.plan.time.comms import predict_collectives

    m = PRESETS["qwen3-30b-a3b"]
    calls = predict_collectives(m, ParallelDims(dp_shard=8, ep=8), sequence_len=4096, micro_batch_size=1)
    a2a = [c for c in calls if c.kind == "all_to_all" and c.mesh_dim == "ep"]
    tokens_in = 4096 * m.top_k * m.hidden * 2  # T·k rows of h bf16 values per rank
    assert [(c.bytes, c.count) for c in a2a] == [(tokens_in, 4 * m.layers), (8 * m.num_experts, m.layers)]
    experts = [c for c in calls if "(experts)" in c.what]
    assert experts == []  # ep = dp_shard·cp·tp: efsdp = 1, each rank holds its experts whole
    fsdp_only = predict_collectives(m, ParallelDims(dp_shard=8), sequence_len=4096)
    assert {c.mesh_dim for c in fsdp_only if "(experts)" in c.what} == {"efsdp"}


def _ep_collectives():
    """One EP 2 step of tiny-qwen3-moe (no aux loss), its collectives counted per mesh dim."""
    from ndparallel import ParallelismConfig
    from ndparallel.engine import Engine, forward_backward
    from ndparallel.runtime.comm_profile import CommProfiler

    engine = Engine(ParallelismConfig(dp_shard_size=2, ep_size=2))
    model = engine.build_model(preset_config("tiny-qwen3-moe", output_router_logits=False))
    ids = torch.randint(0, 256, (1, 32), generator=torch.Generator().manual_seed(engine.rank))
    batch = {"input_ids": ids, "shift_labels": ids, "position_ids": torch.arange(32).unsqueeze(0)}
    with CommProfiler(engine.mesh, engine.built_expert_mesh) as prof:
        forward_backward(engine, model, [batch])
        prof.step()
    return [(r.dim, r.op, r.count) for r in prof.summary() if r.dim == "ep"]


def test_all_to_all_calls_as_the_planner_predicts():
    """The runtime's all-to-alls on ``ep`` per micro-batch (split sizes + dispatch/combine, forward
    and backward, per MoE layer) = the planner's counts for the same model and layout."""
    from ndparallel.plan.models import from_hf_config
    from ndparallel.plan.time.comms import predict_collectives

    got = {op: n for _dim, op, n in run_on_ranks(_ep_collectives, 2)[0]}
    spec = from_hf_config(preset_config("tiny-qwen3-moe").to_dict(), "tiny-qwen3-moe")
    predicted = sum(
        c.count
        for c in predict_collectives(spec, ParallelDims(dp_shard=2, ep=2), sequence_len=32)
        if c.mesh_dim == "ep"
    )
    assert got == {"all_to_all": predicted} and predicted == 5 * spec.layers
