"""Pipeline parallel trains the same model as one process (fp32, SGD): every schedule, PP composed
with FSDP, TP, CP and EP, tied embeddings across stages, on Llama, Qwen3 (tied) and Qwen3-MoE
(without the router loss, which PP refuses)."""

import dataclasses

import pytest
import torch

import faults
from layout_runs import LayoutRuns
from ndparallel.models.presets import preset_config
from ndparallel.parallel.options import ActivationOptions, CPOptions, FSDPOptions, PipelineOptions, TPOptions
from ndparallel.testing import run_on_ranks
from ndparallel.tools.agreement import assert_differs, assert_matches, one_process_reference
from ndparallel.tools.equivalence import TrainSetup, train_under_layout
from pipeline_helpers import train_counting_reductions, world_of

MODELS = {  # 4 decoder layers: 2 stages × 2 virtual stages still get one layer each
    "llama": preset_config("tiny-llama", num_hidden_layers=4),
    "llama_tied": preset_config("tiny-llama-tied", num_hidden_layers=4),
    "qwen3_tied": preset_config("tiny-qwen3", num_hidden_layers=4),
    "qwen3_moe": preset_config("tiny-qwen3-moe", num_hidden_layers=4, output_router_logits=False),
}
BASE = dict(
    steps=2, global_micro_batch=4, grad_accum=2, seq_len=16, optimizer="sgd", lr=0.5, max_grad_norm=1.0
)
ALLGATHER = {"cp_options": CPOptions(comm_strategy="allgather")}

CASES = {  # name: (model, layout, schedule, extra strategy options, pipeline micro-batches)
    "pp2_1f1b": ("llama", {"pp_size": 2}, "1F1B", {}, None),
    "pp2_gpipe_4mb": ("qwen3_tied", {"pp_size": 2}, "GPipe", {}, 4),
    "pp2_interleaved": ("qwen3_tied", {"pp_size": 2}, "Interleaved1F1B", {}, None),
    "pp2_zero_bubble": ("llama", {"pp_size": 2}, "InterleavedZeroBubble", {}, None),
    "pp2_zbv_tied": ("llama_tied", {"pp_size": 2}, "ZBVZeroBubble", {}, None),
    "pp4_tied": ("llama_tied", {"pp_size": 4}, "1F1B", {}, 4),  # the first/last-stage pair group
    "pp2_fsdp2": ("llama", {"pp_size": 2, "dp_shard_size": 2}, "1F1B", {}, None),
    "pp2_tp2_sp_tied": (
        "qwen3_tied",
        {"pp_size": 2, "tp_size": 2},
        "1F1B",
        {"tp_options": TPOptions(sequence_parallel=True)},
        None,
    ),
    "pp2_cp2": ("llama", {"pp_size": 2, "cp_size": 2}, "1F1B", ALLGATHER, None),
    "pp2_dp2_interleaved": (
        "llama_tied",
        {"pp_size": 2, "dp_replicate_size": 2},
        "Interleaved1F1B",
        {},
        None,
    ),
    "pp2_fsdp2_ep2_moe": ("qwen3_moe", {"pp_size": 2, "dp_shard_size": 2, "ep_size": 2}, "1F1B", {}, None),
    "pp2_fsdp2_per_microbatch_reduction": (  # the fallback; pp2_fsdp2 reduces once per step
        "llama_tied",
        {"pp_size": 2, "dp_shard_size": 2},
        "1F1B",
        {"fsdp_options": FSDPOptions(unsharded_grad_accumulation=False)},
        None,
    ),
    "pp2_checkpointing": (
        "llama_tied",
        {"pp_size": 2},
        "1F1B",
        {"activation_options": ActivationOptions(activation_checkpointing=True)},
        None,
    ),
    "pp2_cp2_ulysses": (
        "llama",
        {"pp_size": 2, "cp_size": 2},
        "1F1B",
        {"cp_options": CPOptions(comm_strategy="ulysses")},
        None,
    ),
    "pp2_tp2_sp_interleaved_selective_offload": (  # Meta's 405B recipe in small (docs/planner.md)
        "llama",
        {"pp_size": 2, "tp_size": 2},
        "Interleaved1F1B",
        {
            "tp_options": TPOptions(sequence_parallel=True),
            "activation_options": ActivationOptions(
                activation_checkpointing=True, ac_policy="selective", activation_offloading=True
            ),
        },
        None,
    ),
    "pp2_fsdp2_cpu_offload": (
        "llama_tied",
        {"pp_size": 2, "dp_shard_size": 2},
        "1F1B",
        {"fsdp_options": FSDPOptions(cpu_offload=True)},
        None,
    ),
}


def reference(model: str, **setup):
    return one_process_reference(TrainSetup(MODELS[model], **{**BASE, **setup}))


def pipelined(model, schedule, extra=None, microbatches=None, **setup):
    options = PipelineOptions(schedule=schedule, microbatches=microbatches)
    return TrainSetup(
        MODELS[model], **{**BASE, **setup}, parallel_kwargs={"pipeline_options": options, **(extra or {})}
    )


def _equals_one_process(model, layout, schedule, extra=None, microbatches=None):
    got = run_on_ranks(
        train_under_layout, world_of(layout), pipelined(model, schedule, extra, microbatches), layout
    )[0]
    assert_matches(reference(model), got)


def _mixed_precision(precision: str) -> dict:
    extra = {"mixed_precision": precision, "steps": 3}
    if precision == "fp16":
        extra["loss_scale"] = {"init_scale": 2.0**10}  # every step applies (see test_fp16.py)
    return extra


PACKED = pipelined("qwen3_tied", "1F1B", packed_documents=True)
RUNS = {  # name -> (setup, layout, world): the runs of one layout share a rank group (tests/layout_runs.py)
    **{
        case: (pipelined(model, schedule, extra, microbatches), layout, world_of(layout))
        for case, (model, layout, schedule, extra, microbatches) in CASES.items()
    },
    **{
        precision: (pipelined("llama", "1F1B", **_mixed_precision(precision)), {"pp_size": 2}, 2)
        for precision in ("fp16", "bf16")
    },
    "packed": (PACKED, {"pp_size": 2}, 2),
    "packed_crossing": (dataclasses.replace(PACKED, fault="cross-documents"), {"pp_size": 2}, 2),
}


@pytest.fixture(scope="module")
def runs():
    return LayoutRuns(RUNS)


@pytest.mark.parametrize("case", CASES)
def test_pipeline_layout_equals_one_process(case, runs):
    assert_matches(reference(CASES[case][0]), runs(case))


EIGHT_RANKS = {  # name: (model, layout, schedule)
    "pp2_fsdp2_tp2": ("llama_tied", {"pp_size": 2, "dp_shard_size": 2, "tp_size": 2}, "1F1B"),
    # each stage HSDP: gradients reduce-scattered over dp_shard, all-reduced over dp_replicate
    "pp2_hsdp_2x2": ("qwen3_tied", {"pp_size": 2, "dp_replicate_size": 2, "dp_shard_size": 2}, "1F1B"),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", EIGHT_RANKS)
def test_pipeline_on_8_ranks_equals_one_process(case):
    _equals_one_process(*EIGHT_RANKS[case])


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_pp2_mixed_precision_equals_one_process(precision, runs):
    """fp16 (loss scaling: the scale multiplies the last stage's loss) and bf16 activations
    between stages: the same as one process at that precision."""
    ref = reference("llama", **_mixed_precision(precision))
    got = runs(precision)
    assert_matches(ref, got)
    assert ref.result.loss_scales == got.loss_scales


def test_packed_documents_stay_apart_on_every_stage(runs):
    """Rows packed with several documents: every stage builds its mask from the position_ids it
    receives, so the pipeline trains what one process trains on the same packed rows."""
    ref = reference("qwen3_tied", packed_documents=True)
    assert_matches(ref, runs("packed"))
    assert_differs(ref, runs("packed_crossing"))  # attention across documents is caught


def test_pp2_interleaved_loads_the_model_from_disk(tmp_path):
    """A model read from a directory (meta device → stages → this rank's shards): every stage of a
    rank materialised and its rotary buffers computed, as one process loads it."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(MODELS["llama_tied"]).save_pretrained(tmp_path)
    ref = reference("llama_tied", model_dir=str(tmp_path))
    got = run_on_ranks(
        train_under_layout,
        2,
        pipelined("llama_tied", "Interleaved1F1B", model_dir=str(tmp_path)),
        {"pp_size": 2},
    )[0]
    assert_matches(ref, got)


def test_unsummed_tied_gradients_are_caught(monkeypatch):
    """The negative control: the two stage copies of a tied embedding updated from their own
    gradients only train a different model, and the comparison says so."""
    reference("llama_tied")
    faults.unsummed_tied_grads(monkeypatch)
    got = run_on_ranks(train_under_layout, 2, pipelined("llama_tied", "1F1B"), {"pp_size": 2})[0]
    assert_differs(reference("llama_tied"), got)


def test_bad_pipeline_layouts_fail_before_training():
    from ndparallel.testing import RankFailure

    with pytest.raises(RankFailure, match="4 stages, but the model has 2 decoder layers"):
        run_on_ranks(
            train_under_layout,
            2,
            TrainSetup(
                preset_config("tiny-llama"),
                **BASE,
                parallel_kwargs={"pipeline_options": PipelineOptions(schedule="Interleaved1F1B")},
            ),
            {"pp_size": 2},
        )


def _planned_reductions(unsharded: bool, grad_accum: int) -> int:
    """The planner's reduce-scatters per step on the first stage's rank of the same run."""
    from ndparallel.layout.dims import ParallelDims
    from ndparallel.plan.models import from_hf_config
    from ndparallel.plan.pipeline.pipeline_estimate import pp_rank
    from ndparallel.plan.settings import Settings
    from ndparallel.plan.time.comms import collectives_for

    spec, layout = from_hf_config(MODELS["llama"].to_dict()), ParallelDims(pp=2, dp_shard=2)
    s = Settings(
        sequence_len=BASE["seq_len"],
        gradient_accumulation_steps=grad_accum,
        unsharded_grad_accumulation=unsharded,
    )
    _, part, rank_s = pp_rank(spec, layout, s, 0)
    return sum(c.count for c in collectives_for(part, layout, rank_s) if c.kind == "reduce_scatter")


def test_unsharded_accumulation_reduces_gradients_once_per_step():
    """FSDP under PP: by default the stage is torch's FSDP root and reduces once per step
    (unsharded_grad_accumulation None = on under PP); with unsharded_grad_accumulation=False, the
    fallback, every pipeline micro-batch reduce-scatters (gradients stay sharded). The planner
    counts the same reductions (one foreach_reduce per FSDP unit and reduction)."""
    layout = {"pp_size": 2, "dp_shard_size": 2}
    once = pipelined("llama", "1F1B", grad_accum=4)
    sharded = dataclasses.replace(
        once,
        parallel_kwargs={
            **once.parallel_kwargs,
            "fsdp_options": FSDPOptions(unsharded_grad_accumulation=False),
        },
    )
    per_micro_batch = run_on_ranks(train_counting_reductions, 4, sharded, layout)[0][1]
    per_step = run_on_ranks(train_counting_reductions, 4, once, layout)[0][1]
    assert per_micro_batch == 4 * per_step > 0  # 4 micro-batches per step
    steps = sharded.steps
    assert (per_micro_batch, per_step) == (
        steps * _planned_reductions(False, 4),
        steps * _planned_reductions(True, 4),
    )
