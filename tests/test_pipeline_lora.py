"""Pipeline parallel with LoRA trains the same adapter as LoRA on one process (fp32, SGD): each stage
holds its layers' adapters, names them as the whole PEFT model does, and the seeded adapter init of
a model read from disk is the whole model's on every stage. (QLoRA under PP: tests/test_qlora.py;
checkpoints and exports across pipeline degrees: tests/test_pipeline_train.py.)"""

import dataclasses

import peft  # noqa: F401  (imported once before the ranks fork)
import pytest
import torch

from ndparallel.models.presets import preset_config
from ndparallel.parallel.options import CPOptions, FSDPOptions, PipelineOptions
from ndparallel.testing import run_on_ranks
from ndparallel.tools.agreement import assert_matches, one_process_reference
from ndparallel.tools.equivalence import TrainSetup
from pipeline_helpers import train_counting_reductions, world_of

LORA = dict(r=4, alpha=8, dropout=0.0, target_linear=True)
SETUP = dict(
    steps=2, global_micro_batch=4, grad_accum=2, seq_len=16, optimizer="sgd", lr=0.5, max_grad_norm=1.0
)
CASES = {  # name: (model, LoRA extras, layout, schedule, strategy options)
    # tied embeddings, frozen: both stage copies stay the base's; two stages per rank in one view
    "pp2_interleaved_tied": ("tiny-llama-tied", {}, {"pp_size": 2}, "Interleaved1F1B", {}),
    # trained embedding and head copies on the first and the last stage; the stage an FSDP root
    "pp2_fsdp2_modules_to_save": (
        "tiny-llama",
        {"modules_to_save": ["embed_tokens", "lm_head"]},
        {"pp_size": 2, "dp_shard_size": 2},
        "1F1B",
        {"fsdp_options": FSDPOptions(unsharded_grad_accumulation=True)},
    ),
    # each stage's base and adapter linears sharded by TP (the adapters as the layers they adapt)
    "pp2_tp2": ("tiny-llama", {}, {"pp_size": 2, "tp_size": 2}, "1F1B", {}),
    # each stage's sequence split by CP (all-gather: gloo's ring P2P beside the pipeline's is refused)
    "pp2_cp2": (
        "tiny-llama",
        {},
        {"pp_size": 2, "cp_size": 2},
        "1F1B",
        {"cp_options": CPOptions(comm_strategy="allgather")},
    ),
    # a mixture-of-experts model's stages with their experts split by EP (the adapters on attention)
    "pp2_fsdp2_ep2_moe": ("tiny-qwen3-moe", {}, {"pp_size": 2, "dp_shard_size": 2, "ep_size": 2}, "1F1B", {}),
    # adapters on the experts' fused weights too (PEFT's target_parameters), each stage its layers'
    "pp2_moe_target_parameters": (
        "tiny-qwen3-moe",
        {
            "target_linear": False,
            "target_modules": ["q_proj", "v_proj"],
            "target_parameters": ["experts.gate_up_proj", "experts.down_proj"],
        },
        {"pp_size": 2},
        "1F1B",
        {},
    ),
}


def _setup(model: str, lora_extra: dict) -> TrainSetup:
    moe = {"output_router_logits": False} if "moe" in model else {}  # PP refuses the router loss
    return TrainSetup(
        preset_config(model, num_hidden_layers=4, **moe), **SETUP, adapter={**LORA, **lora_extra}
    )


@pytest.mark.parametrize("case", CASES)
def test_pipeline_lora_equals_one_process_lora(case):
    model, extra, layout, schedule, options = CASES[case]
    setup = _setup(model, extra)
    reference = one_process_reference(setup)
    ref = reference.result
    staged = dataclasses.replace(
        setup, parallel_kwargs={"pipeline_options": PipelineOptions(schedule=schedule), **options}
    )
    world = world_of(layout)
    got, reductions = run_on_ranks(train_counting_reductions, world, staged, layout)[0]
    assert_matches(reference, got)
    b = [k for k in ref.params if ".lora_B." in k]
    assert any(".layers.3." in k for k in b) and max(ref.params[k].abs().max().item() for k in b) > 1e-3
    if "target_parameters" in extra:  # the experts' own adapters trained, on both stages
        experts = [k for k in b if ".mlp.experts." in k]
        assert any(".layers.0." in k for k in experts) and any(".layers.3." in k for k in experts)
        assert max(ref.params[k].abs().max().item() for k in experts) > 1e-4
    if "fsdp_options" in options:  # the stage is FSDP's root: one reduction per step, not per micro-batch
        per_micro_batch = run_on_ranks(
            train_counting_reductions,
            world,
            dataclasses.replace(
                staged,
                parallel_kwargs={  # the fallback: reduced every micro-batch
                    **staged.parallel_kwargs,
                    "fsdp_options": FSDPOptions(unsharded_grad_accumulation=False),
                },
            ),
            layout,
        )[0][1]
        assert per_micro_batch == SETUP["grad_accum"] * reductions > 0


def _initial_adapters(_):
    """This pp rank's initial adapters of a meta model (as read from disk), by the whole model's
    seeded order and (the negative control) by the rank's own parameters only."""
    from ndparallel import ParallelismConfig
    from ndparallel.engine import Engine
    from ndparallel.models.adapters import WHOLE_TRAINED, initial_adapter_weights, lora_config
    from ndparallel.models.loading import build_on_meta_from_config

    engine = Engine(ParallelismConfig(pp_size=2))
    config = preset_config("tiny-llama", num_hidden_layers=4)
    view = engine.parallelize(
        build_on_meta_from_config(config, torch.float32, "sdpa", adapter=lora_config(**LORA))
    )
    whole = initial_adapter_weights(view, seed=0)
    setattr(view, WHOLE_TRAINED, None)
    return whole, initial_adapter_weights(view, seed=0)


def test_a_stage_draws_the_whole_models_adapter_init():
    from ndparallel.models.adapters import initial_adapter_weights, lora_config
    from ndparallel.models.loading import build_on_meta_from_config

    config = preset_config("tiny-llama", num_hidden_layers=4)
    one = initial_adapter_weights(
        build_on_meta_from_config(config, torch.float32, "sdpa", adapter=lora_config(**LORA)), seed=0
    )
    (first, _), (last, own_order) = run_on_ranks(_initial_adapters, 2, None)
    assert set(first) | set(last) == set(one) and not set(first) & set(last)
    assert all(torch.equal(one[k], t) for k, t in {**first, **last}.items())
    a = "base_model.model.model.layers.2.self_attn.q_proj.lora_A.default.weight"
    assert not torch.equal(own_order[a], one[a])  # drawn from the stage's own start: another model
