"""Regional ``torch.compile`` of the decoder layers trains the same model as eager, composed with
FSDP2 + activation checkpointing (inductor), TP with sequence parallel, CP, FSDP2 x CP and pipeline
stages (``aot_eager``: dynamo and AOT autograd, the parts that meet our hooks and DTensors, without
the C++ build that makes inductor take ~1 min per graph on 2 cores). fp32, SGD: tools.agreement's bounds.
Each rank also reports how many graphs dynamo built and where it broke them (CP and TP + SP:
around ndparallel's attention, which runs eagerly by design)."""

import dataclasses

import pytest

from ndparallel.models.presets import preset_config
from ndparallel.parallel.options import ActivationOptions, TPOptions
from ndparallel.techniques.technique_options import CompileOptions
from ndparallel.testing import run_on_ranks
from ndparallel.tools.agreement import assert_matches, one_process_reference
from ndparallel.tools.equivalence import TrainSetup, train_under_layout

BASE = TrainSetup(
    preset_config("tiny-llama"),
    steps=2,
    global_micro_batch=4,
    seq_len=32,
    optimizer="sgd",
    lr=0.5,
    max_grad_norm=1.0,
)


def _train_and_count(setup, layout):
    import torch._dynamo

    torch._dynamo.reset()
    result = train_under_layout(setup, layout)
    counters = torch._dynamo.utils.counters
    # the checkpoint side-effect switch is on only while the model runs (techniques/compile.py)
    assert not torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint
    return result, counters["stats"].get("unique_graphs", 0), sum(counters["graph_break"].values())


def _check(layout, world, backend, **kwargs):
    setup = dataclasses.replace(
        BASE, parallel_kwargs={**kwargs, "compile_options": CompileOptions(enabled=True, backend=backend)}
    )
    got, graphs, breaks = run_on_ranks(_train_and_count, world, setup, layout, timeout_s=600)[0]
    assert_matches(one_process_reference(BASE), got)
    assert graphs >= 1, "nothing was compiled"
    return graphs, breaks


def test_fsdp2_activation_checkpointing_inductor():
    """No graph break: transformers >= 5.25's attention sets and resets a module-level variable
    (the ``kernels`` package), which dynamo refuses inside a checkpoint unless told not to replay it."""
    graphs, breaks = _check(
        {"dp_shard_size": 2},
        2,
        "inductor",
        activation_options=ActivationOptions(activation_checkpointing=True),
    )
    assert breaks == 0, breaks


def test_tp2_sequence_parallel():
    """Under SP the attention is ndparallel's document attention (masks from the positions, so
    packed rows work): like the CP attention it runs eagerly, one graph break per layer."""
    _, breaks = _check({"tp_size": 2}, 2, "aot_eager", tp_options=TPOptions(sequence_parallel=True))
    assert breaks == 2, breaks


def test_cp2_attention_is_the_graph_break():
    _, breaks = _check({"cp_size": 2}, 2, "aot_eager")
    assert breaks >= 1, "the CP attention should run eagerly (a graph break)"


def test_compile_keeps_parameter_names():
    import torch
    from transformers import AutoModelForCausalLM

    from ndparallel.techniques.compile import apply_compile

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(preset_config("tiny-llama"))
    names = [n for n, _ in model.named_parameters()]
    apply_compile(model, CompileOptions(enabled=True))
    assert [n for n, _ in model.named_parameters()] == names
    assert all(layer._compiled_call_impl is not None for layer in model.model.layers)


def test_tp_compiles_attention_and_mlp_only():
    import torch
    from transformers import AutoModelForCausalLM

    from ndparallel.techniques.compile import apply_compile

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(preset_config("tiny-llama"))
    apply_compile(model, CompileOptions(enabled=True), per_child=True)
    layer = model.model.layers[0]
    assert layer._compiled_call_impl is None
    assert layer.self_attn._compiled_call_impl is not None and layer.mlp._compiled_call_impl is not None
    assert layer.input_layernorm._compiled_call_impl is None


@pytest.mark.slow
def test_fsdp2_tp2_sequence_parallel_activation_checkpointing_4_ranks():
    _check(
        {"dp_shard_size": 2, "tp_size": 2},
        4,
        "aot_eager",
        tp_options=TPOptions(sequence_parallel=True),
        activation_options=ActivationOptions(activation_checkpointing=True),
    )


def test_fsdp2_cp2_activation_checkpointing_4_ranks():
    """FSDP2 + CP + AC under compile: dynamo cannot break a graph inside a checkpointed layer, so
    the MLPs are compiled and the CP attention blocks run eagerly (no break; a layer-wide unit
    would compile nothing: 0 graphs, seen before the fix)."""
    graphs, breaks = _check(
        {"dp_shard_size": 2, "cp_size": 2},
        4,
        "aot_eager",
        activation_options=ActivationOptions(activation_checkpointing=True),
    )
    assert breaks == 0, breaks


def test_pipeline_stages_compile_with_activation_checkpointing():
    """PP 2 (1F1B, 2 micro-batches): each stage's decoder layers compiled as without PP, under
    activation checkpointing; = one eager process."""
    from ndparallel.parallel.options import PipelineOptions

    _check(
        {"pp_size": 2},
        2,
        "aot_eager",
        pipeline_options=PipelineOptions(schedule="1F1B", microbatches=2),
        activation_options=ActivationOptions(activation_checkpointing=True),
    )
