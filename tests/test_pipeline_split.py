"""Pipeline stage arithmetic and the pipeline layout's refusals (no ranks: pure functions)."""

import pytest

from ndparallel import ParallelismConfig, ParallelismConfigError
from ndparallel.parallel.options import PipelineOptions
from ndparallel.parallel.pp.split import pipeline_problem, plan_stages, stage_layers


def test_even_split_gives_the_first_stages_the_extra_layers():
    assert stage_layers(PipelineOptions(), 3, 8) == ((0, 1, 2), (3, 4, 5), (6, 7))
    assert stage_layers(PipelineOptions(layers_per_stage=2), 2, 4) == ((0, 1), (2, 3))
    assert stage_layers(PipelineOptions(split_points=(1, 3)), 3, 4) == ((0,), (1, 2), (3,))


def test_stage_placement_per_schedule():
    loop = plan_stages(PipelineOptions(schedule="Interleaved1F1B"), 2, 8)
    assert loop.n_stages == 4 and loop.stages_of(0) == [0, 2] and loop.stages_of(1) == [1, 3]
    v = plan_stages(PipelineOptions(schedule="ZBVZeroBubble"), 2, 8)
    assert v.stages_of(0) == [0, 3] and v.stages_of(1) == [1, 2]  # the V: first and last on rank 0
    assert plan_stages(PipelineOptions(), 4, 8).stages_of(3) == [3]


@pytest.mark.parametrize(
    "options, pp, layers, mbs, words",
    [
        (PipelineOptions(schedule="PipeDream"), 2, 4, 4, "pipeline_schedule='PipeDream' is not a schedule"),
        (PipelineOptions(), 8, 4, 8, "8 stages, but the model has 4 decoder layers"),
        (PipelineOptions(schedule="Interleaved1F1B"), 4, 6, 8, "8 stages, but the model has 6"),
        (PipelineOptions(), 4, 8, 2, "at least 4"),
        (PipelineOptions(schedule="Interleaved1F1B"), 2, 8, 3, "multiple of pipeline_parallel_size=2"),
        (PipelineOptions(schedule="1F1B", virtual_stages=2), 2, 8, 4, "runs one stage per rank"),
        (PipelineOptions(schedule="ZBVZeroBubble", virtual_stages=3), 2, 12, 4, "exactly 2 stages per rank"),
        (PipelineOptions(layers_per_stage=3), 2, 8, 4, "pipeline_layers_per_stage=3 × 2 stages = 6"),
        (PipelineOptions(split_points=(5, 2)), 3, 8, 4, "increasing layer indices"),
    ],
)
def test_bad_pipelines_are_refused_in_one_line(options, pp, layers, mbs, words):
    problem = pipeline_problem(options, pp, layers, mbs)
    assert problem and words in problem and "\n" not in problem


def test_a_good_pipeline_has_no_problem():
    assert pipeline_problem(PipelineOptions(schedule="interleaved1f1b"), 2, 8, 4) is None  # any case


def test_pp_size_is_a_degree_like_the_others(monkeypatch):
    pc = ParallelismConfig(pp_size=2, dp_shard_size=-1, tp_size=2).resolve(8)
    assert (pc.pp_size, pc.dp_shard_size, pc.total_size) == (2, 2, 8)
    assert pc.dims.pp == 2 and pc.dims.stage_world == 4 and pc.dims.dp == 2
    assert pc.to_dict()["pp_size"] == 2 and "PP 2" in pc.describe()
    monkeypatch.setenv("NDPARALLEL_PP_SIZE", "4")
    assert ParallelismConfig().pp_size == 4
    with pytest.raises(ParallelismConfigError, match="pp_size=-1 is not allowed"):
        ParallelismConfig(pp_size=-1)
    with pytest.raises(ParallelismConfigError, match="pp_size × dp_replicate_size"):
        ParallelismConfig(pp_size=2, dp_shard_size=2).resolve(8)


def test_bubble_share_per_schedule():
    from ndparallel.parallel.pp.split import bubble_fraction

    assert bubble_fraction(plan_stages(PipelineOptions(), 4, 8), 12) == 3 / 15  # (p-1)/(m+p-1)
    assert bubble_fraction(plan_stages(PipelineOptions(schedule="Interleaved1F1B"), 4, 8), 12) == 3 / 27
    assert bubble_fraction(plan_stages(PipelineOptions(schedule="ZBVZeroBubble"), 2, 8), 4) == 0.0
