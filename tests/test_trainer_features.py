"""The Trainer's own features through the door (``tests/trainer_scripts/trainer_features.py``: gradient
accumulation, ``logging_steps``, evaluation, ``save_steps``, ``resume_from_checkpoint``, ``save_model``,
a ``report_to`` tracker, a callback, bf16, epochs, ``use_cpu`` on gloo ranks) equal transformers' own
Trainer on Accelerate in one process with the same global batch (``tests/fixtures/trainer/
trainer_features.json``, recorded by ``bench/peers/hf_trainer.py``), under the project's rule; and
what the door cannot honour is refused while the arguments or the trainer are built, in one line."""

from __future__ import annotations

import importlib.util
import warnings

import pytest

from ndparallel.testing import run_on_ranks
from ndparallel.tools.agreement import Reference, assert_matches, stated_bounds
from ndparallel.tools.equivalence import TrainResult
from ndparallel.tools.verify import BF16_TOLERANCE
from sft_fixtures import tiny_llama_dir, weights_checksum
from trainer_door_helpers import QUIET_HUB, fixture, logged, peer_reference, steps_of

RECORDED = fixture("trainer_features")
FSDP2_CP2 = {"dp_shard_size": 2, "cp_size": 2}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tiny_llama_dir(tmp_path_factory.mktemp("tiny-llama"))
    assert weights_checksum(path) == RECORDED["model"]["checksum"], "rerun python bench/peers/hf_trainer.py"
    return path


@pytest.fixture(scope="module")
def model_config(model_dir):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def out_root(tmp_path_factory):
    return tmp_path_factory.mktemp("runs")


def _script(argv):
    from trainer_scripts import trainer_features

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return trainer_features.main(argv)


def _features(layout: dict, model_dir, out, *own, env: dict | None = None) -> list[dict]:
    world = 1
    for size in layout.values():
        world *= size
    env = {f"PARALLELISM_CONFIG_{k.upper()}": str(v) for k, v in layout.items()} | QUIET_HUB | (env or {})
    argv = ["--model-name", str(model_dir), "--save-dir", str(out), *RECORDED["argv"], *own]
    return run_on_ranks(_script, world, argv, env=env)


_first: dict = {}


def _fsdp2_cp2(model_dir, out_root) -> dict:
    """The fp32 run on FSDP 2 × CP 2 (per-device batch 1: the peer's 2 over two dp ranks), once."""
    if not _first:
        out = out_root / "fsdp2xcp2"
        own = ["--per-device-batch-size", "1", "--max-steps", "4", "--report-to", "tensorboard"]
        _first.update(_features(FSDP2_CP2, model_dir, out, *own)[0], out=out)
    return _first


def test_features_on_fsdp2_cp2_equal_transformers_trainer(model_dir, model_config, out_root):
    run = _fsdp2_cp2(model_dir, out_root)
    peer = RECORDED["runs"]["fp32"]["first"]
    assert_matches(peer_reference(RECORDED, "fp32", model_config), steps_of(run["history"]))
    evaluations = peer_reference(RECORDED, "fp32", model_config, metric="eval_losses")
    assert_matches(evaluations, logged(run["history"], "eval_loss"), compared=("loss_rel",))
    assert run["callback_steps"] == peer["callback_steps"] == [1, 2, 3, 4]
    out = run["out"]
    assert (out / "checkpoint-2" / "ndparallel_state" / "COMPLETE").is_file()
    assert list(out.glob("runs/**/events.out.tfevents*")), "report_to=tensorboard wrote no events"
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(out)


def test_resume_onto_another_layout_continues_the_same_training(model_dir, model_config, out_root):
    """checkpoint-2 of the FSDP 2 × CP 2 run, resumed on TP 2 with sequence parallel (one dp rank:
    per-device batch 2, the same global batch; SP from ``NDPARALLEL_SEQUENCE_PARALLEL``, which
    ``ParallelismConfig()``'s tp handler reads): steps 3 and 4 see the same data and equal the peer's
    uninterrupted run, and so does the evaluation at step 4."""
    checkpoint = _fsdp2_cp2(model_dir, out_root)["out"] / "checkpoint-2"
    own = ["--per-device-batch-size", "2", "--max-steps", "4", "--resume", str(checkpoint)]
    sp = {"NDPARALLEL_SEQUENCE_PARALLEL": "1"}
    run = _features({"tp_size": 2}, model_dir, out_root / "resumed-tp2-sp", *own, env=sp)[0]
    assert run["callback_steps"] == [3, 4]
    reference = peer_reference(RECORDED, "fp32", model_config, start=2)
    assert_matches(reference, steps_of(run["history"], start=2))
    evaluation = peer_reference(RECORDED, "fp32", model_config, metric="eval_losses", start=1)
    after_resume = [h for h in run["history"] if h["step"] > 2]  # the history resumes with steps 1-2
    assert_matches(evaluation, logged(after_resume, "eval_loss"), compared=("loss_rel",))


def test_bf16_epochs_on_fsdp2(model_dir, out_root):
    """bf16 for one epoch (8 rows, global batch 4: 2 steps) against the peer's bf16 run: bf16 rounds
    each side differently, held to the stated low-precision bound ``verify`` uses."""
    own = ["--per-device-batch-size", "1", "--max-steps", "-1", "--rows", "8", "--bf16"]
    run = _features({"dp_shard_size": 2}, model_dir, out_root / "bf16", *own)[0]
    got = steps_of(run["history"])
    peer = RECORDED["runs"]["bf16_epoch"]["first"]
    assert len(got.losses) == len(peer["losses"]) == 2 and run["history"][-1]["step"] == 2
    reference = Reference(
        TrainResult(peer["losses"], peer["grad_norms"], None),
        stated_bounds(BF16_TOLERANCE, f"stated {BF16_TOLERANCE:.0e}: bf16 on both sides, rounded apart"),
    )
    assert_matches(reference, got)


def _trl_sft_with_sequence_parallel(model, out: str):
    from datasets import Dataset

    from ndparallel import ParallelismConfig
    from ndparallel.trl import SFTConfig, SFTTrainer
    from ndparallel.utils import TorchTensorParallelConfig

    handler = TorchTensorParallelConfig(sequence_parallel=True)
    pc = ParallelismConfig(tp_size=2, tp_handler=handler)
    config = SFTConfig(out, use_cpu=True, report_to="none", parallelism_config=pc)
    return SFTTrainer(model, config, train_dataset=Dataset.from_dict({"input_ids": [[1, 2, 3]]}))


def _refusals(model_dir: str, out: str) -> dict[str, str]:
    """Each bad setting's error message (or "accepted"), built on this rank."""
    import transformers
    from accelerate.parallelism_config import ParallelismConfig as AcceleratePC
    from transformers import AutoModelForCausalLM

    from ndparallel import ParallelismConfig
    from ndparallel.transformers import Trainer, TrainingArguments
    from ndparallel.utils import TorchTensorParallelConfig

    model = AutoModelForCausalLM.from_pretrained(model_dir)

    def args(**kwargs):
        return TrainingArguments(out, use_cpu=True, report_to="none", **kwargs)

    def trainer(training_args, **kwargs):
        return Trainer(model, training_args, **kwargs)

    cases = {
        "deepspeed": lambda: args(deepspeed={"train_micro_batch_size_per_gpu": 1}),
        "fsdp": lambda: args(fsdp="full_shard auto_wrap"),
        "fsdp (transformers' own arguments)": lambda: trainer(
            transformers.TrainingArguments(out, use_cpu=True, fsdp="full_shard")
        ),
        "torch_compile_mode": lambda: args(torch_compile=True, torch_compile_mode="max-autotune"),
        "optim": lambda: args(optim="lomo"),
        "pp_size": lambda: args(parallelism_config=ParallelismConfig(pp_size=2)),
        "parallelism_config": lambda: trainer(
            transformers.TrainingArguments(out, use_cpu=True, parallelism_config=AcceleratePC())
        ),
        "dp_shard_size": lambda: trainer(args(parallelism_config=ParallelismConfig(dp_shard_size=3))),
        "average_tokens_across_devices": lambda: trainer(
            args(average_tokens_across_devices=False, parallelism_config=ParallelismConfig(dp_shard_size=2))
        ),
        "compute_metrics": lambda: trainer(
            args(parallelism_config=ParallelismConfig(cp_size=2)), compute_metrics=lambda p: {}
        ),
        "label_smoothing_factor": lambda: trainer(
            args(label_smoothing_factor=0.1, parallelism_config=ParallelismConfig(cp_size=2))
        ),
        "accepted": lambda: trainer(args(parallelism_config=ParallelismConfig(dp_shard_size=2))),
    }
    if importlib.util.find_spec("trl") is not None:
        cases["sequence_parallel (TRL)"] = lambda: _trl_sft_with_sequence_parallel(model, out)
    messages = {}
    for name, build in cases.items():
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                build()
            messages[name] = "accepted"
        except ValueError as e:
            messages[name] = str(e)
    handler = TorchTensorParallelConfig(sequence_parallel=True)
    built = trainer(args(parallelism_config=ParallelismConfig(tp_size=2, tp_handler=handler)))
    return {"messages": messages, "sequence_parallel": built.accelerator.tp_options.sequence_parallel}


def test_what_the_door_cannot_honour_is_refused_in_one_line(model_dir, tmp_path):
    """... and what it can is taken: sequence parallel from the tp handler."""
    results = run_on_ranks(_refusals, 2, str(model_dir), str(tmp_path), env=QUIET_HUB)
    assert results[0] == results[1] and results[0]["sequence_parallel"] is True
    for case, message in results[0]["messages"].items():
        field = case.split()[0]
        if field == "accepted":
            assert message == "accepted"
            continue
        assert field in message and "\n" not in message, (case, message)
