"""TRL through the door (``ndparallel.trl``): an SFT script (prompt/completion data with its
completion-only loss, chat data packed, padding-free rows) and a DPO script (the reference model TRL
builds, sharded like the policy; the adapter-disabled base of a LoRA policy), their imports changed
only, train on CPU ranks what TRL itself trains in one process with the same global batch
(``tests/fixtures/trainer/trl_*.json``, recorded by ``bench/peers/hf_trainer.py``): the logged
losses and gradient norms, and DPO's reward margins, under the project's rule."""

from __future__ import annotations

import importlib
import warnings

import pytest

pytest.importorskip("trl")

from ndparallel.testing import run_on_ranks  # noqa: E402
from ndparallel.tools.agreement import assert_matches  # noqa: E402
from sft_fixtures import tiny_llama_dir, weights_checksum  # noqa: E402
from trainer_door_helpers import QUIET_HUB, fixture, logged, peer_reference, steps_of  # noqa: E402

SFT, DPO = fixture("trl_sft"), fixture("trl_dpo")
CP2, TP2, FSDP2_TP2 = {"cp_size": 2}, {"tp_size": 2}, {"dp_shard_size": 2, "tp_size": 2}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tiny_llama_dir(tmp_path_factory.mktemp("tiny-llama"))
    assert weights_checksum(path) == SFT["model"]["checksum"], "rerun python bench/peers/hf_trainer.py"
    return path


@pytest.fixture(scope="module")
def model_config(model_dir):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model_dir)


def _script(name: str, argv: list[str]) -> list[dict]:
    module = importlib.import_module(f"trainer_scripts.{name}")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return module.main(argv)


def _run(name: str, recorded: dict, run: str, layout: dict, model_dir, out) -> list[dict]:
    """The script's run ``run`` on ``layout``, the per-device batch divided over its dp ranks (the
    peer's global batch); rank 0's log history."""
    own = list(recorded["run_argv"][run])
    dp = layout.get("dp_replicate_size", 1) * layout.get("dp_shard_size", 1)
    at = own.index("--per-device-batch-size") + 1
    own[at] = str(int(own[at]) // dp)
    world = 1
    for size in layout.values():
        world *= size
    env = {f"PARALLELISM_CONFIG_{k.upper()}": str(v) for k, v in layout.items()} | QUIET_HUB
    argv = ["--model-name", str(model_dir), "--save-dir", str(out), *recorded["argv"], *own]
    return run_on_ranks(_script, world, name, argv, env=env)[0]


@pytest.mark.parametrize(
    "run, layout",
    [("padding_free", CP2), ("prompt_completion", TP2), ("chat_packed", FSDP2_TP2)],
    ids=["padding-free-cp2", "completion-only-tp2", "chat-packed-fsdp2xtp2"],
)
def test_sft_equals_trl(run, layout, model_dir, model_config, tmp_path):
    history = _run("trl_sft", SFT, run, layout, model_dir, tmp_path)
    assert_matches(peer_reference(SFT, run, model_config), steps_of(history))


@pytest.mark.parametrize(
    "run, layout", [("full", TP2), ("lora", FSDP2_TP2)], ids=["reference-model-tp2", "lora-fsdp2xtp2"]
)
def test_dpo_equals_trl(run, layout, model_dir, model_config, tmp_path):
    history = _run("trl_dpo", DPO, run, layout, model_dir, tmp_path)
    assert_matches(peer_reference(DPO, run, model_config), steps_of(history))
    margins = peer_reference(DPO, run, model_config, metric="rewards/margins")
    assert_matches(margins, logged(history, "rewards/margins"), compared=("loss_rel",))


def _dpo_on_cp(model_dir: str, out: str) -> str:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ndparallel import ParallelismConfig
    from ndparallel.trl import DPOConfig, DPOTrainer
    from trainer_scripts.trl_dpo import dataset

    config = DPOConfig(out, use_cpu=True, report_to="none", parallelism_config=ParallelismConfig(cp_size=2))
    try:
        DPOTrainer(
            model=AutoModelForCausalLM.from_pretrained(model_dir),
            args=config,
            train_dataset=dataset(4),
            processing_class=AutoTokenizer.from_pretrained(model_dir),
        )
    except ValueError as e:
        return str(e)
    return "accepted"


def test_dpo_refuses_context_parallel_when_built(model_dir, tmp_path):
    """DPO's loss is a function of whole-sequence log-probability sums: a layout that splits the
    sequences is refused while the trainer is built, in one line."""
    message = run_on_ranks(_dpo_on_cp, 2, str(model_dir), str(tmp_path), env=QUIET_HUB)[0]
    assert "cp_size=1" in message and "DPOTrainer" in message and "\n" not in message, message


def test_the_trl_classes_are_trls_with_the_door_under_them():
    import trl

    import ndparallel.trl as door
    from ndparallel.transformers import TrainerDoor

    for ours, theirs in ((door.SFTTrainer, trl.SFTTrainer), (door.DPOTrainer, trl.DPOTrainer)):
        assert issubclass(ours, theirs) and issubclass(ours, TrainerDoor)
        assert ours.__mro__.index(theirs) < ours.__mro__.index(TrainerDoor)  # TRL's overrides run first
    assert issubclass(door.SFTConfig, trl.SFTConfig) and issubclass(door.DPOConfig, trl.DPOConfig)
    assert trl.SFTTrainer.compute_loss.__module__.startswith("trl.")  # nothing patched
