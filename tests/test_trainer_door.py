"""The Trainer door (``ndparallel.transformers``): our copy of Accelerate's ``nd_parallel_trainer.py``,
its imports pointed at ndparallel, trains on CPU ranks the model transformers' own ``Trainer`` on
Accelerate trains in one process with the same global batch (``tests/fixtures/trainer/``, recorded
by ``bench/peers/hf_trainer.py``): the logged losses and gradient norms under the project's rule
(``tools/agreement.py``, bounds from the peer's own second way and the fp32 floor), and the saved
model loads with ``from_pretrained``. Importing the door leaves transformers' classes as they were."""

from __future__ import annotations

import pytest
import torch

from ndparallel.testing import run_on_ranks
from ndparallel.tools.agreement import assert_differs, assert_matches
from sft_fixtures import tiny_llama_dir, tiny_moe_dir, weights_checksum
from trainer_door_helpers import QUIET_HUB, fixture, peer_reference, run_trainer_script, steps_of

RECORDED = fixture("nd_parallel_trainer")
LAYOUTS = {
    "one-rank": {},
    "cp2": {"cp_size": 2},
    "tp2": {"tp_size": 2},
    "dp2": {"dp_replicate_size": 2},
    "fsdp2": {"dp_shard_size": 2},
    "fsdp2xcp2": {"dp_shard_size": 2, "cp_size": 2},
    "hsdp2x2": {"dp_replicate_size": 2, "dp_shard_size": 2},
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tiny_llama_dir(tmp_path_factory.mktemp("tiny-llama"))
    assert weights_checksum(path) == RECORDED["model"]["checksum"], (
        "tests/sft_fixtures.py builds another model than the fixture was recorded on: rerun "
        "python bench/peers/hf_trainer.py"
    )
    return path


@pytest.fixture(scope="module")
def model_config(model_dir):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model_dir)


_runs: dict[str, tuple] = {}


def _run(name: str, model_dir, out_root) -> tuple:
    """(logged steps of rank 0, every rank's history, the output folder) of the script on a layout,
    run once per module."""
    if name not in _runs:
        layout = LAYOUTS[name]
        out = out_root / name
        argv = ["--model-name", str(model_dir), "--save-dir", str(out), *RECORDED["argv"]]
        histories = run_trainer_script(layout, argv)
        _runs[name] = (steps_of(histories[0]), histories, out)
    return _runs[name]


@pytest.fixture(scope="module")
def out_root(tmp_path_factory):
    return tmp_path_factory.mktemp("runs")


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_nd_parallel_trainer_script_equals_transformers_trainer(name, model_dir, model_config, out_root):
    got, histories, out = _run(name, model_dir, out_root)
    sizes = LAYOUTS[name]
    dp = sizes.get("dp_replicate_size", 1) * sizes.get("dp_shard_size", 1)
    assert_matches(peer_reference(RECORDED, f"batch{dp}", model_config), got)
    assert all(steps_of(h) == got for h in histories)  # every rank logs the same global values
    from transformers import AutoModelForCausalLM

    before = AutoModelForCausalLM.from_pretrained(model_dir).state_dict()
    after = AutoModelForCausalLM.from_pretrained(out).state_dict()
    assert set(after) == set(before) and any(not torch.equal(after[k], before[k]) for k in before)


MOE = fixture("nd_parallel_trainer_moe")


def _expert_parallel_script(argv: list[str]) -> dict:
    """The script on this rank, its ``Trainer`` recording the layout the engine built."""
    import warnings

    from accelerate_scripts import nd_parallel_trainer

    built = {}

    class Recording(nd_parallel_trainer.Trainer):
        def train(self, *args, **kwargs):
            built["ep"] = self.accelerator.engine.dims.ep
            return super().train(*args, **kwargs)

    nd_parallel_trainer.Trainer = Recording  # this forked rank's copy of the module only
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return {"history": nd_parallel_trainer.main(argv), **built}


def test_expert_parallel_equals_transformers_trainer(tmp_path):
    """A tiny Qwen3-MoE (its router's load-balancing loss in the loss) on FSDP 2 with its experts
    split over 2 ranks (``NDPARALLEL_EP_SIZE``: Accelerate has no expert parallel) trains what
    transformers' own Trainer trains in one process with the same global batch."""
    from transformers import AutoConfig

    model = tiny_moe_dir(tmp_path / "tiny-moe")
    assert weights_checksum(model) == MOE["model"]["checksum"], "rerun python bench/peers/hf_trainer.py"
    argv = ["--model-name", str(model), "--save-dir", str(tmp_path / "out"), *MOE["argv"]]
    env = {"PARALLELISM_CONFIG_DP_SHARD_SIZE": "2", "NDPARALLEL_EP_SIZE": "2"} | QUIET_HUB
    ranks = run_on_ranks(_expert_parallel_script, 2, argv, env=env)
    assert [r["ep"] for r in ranks] == [2, 2]
    assert_matches(
        peer_reference(MOE, "batch2", AutoConfig.from_pretrained(model)), steps_of(ranks[0]["history"])
    )


def test_the_comparison_tells_another_global_batch(model_dir, model_config, out_root):
    """Negative control: the one-rank run (global batch 1) is not the peer's batch-2 training."""
    got, _, _ = _run("one-rank", model_dir, out_root)
    assert_differs(peer_reference(RECORDED, "batch2", model_config), got)


def _foreign_attributes(cls: type, package: str) -> list[str]:
    """Functions in ``cls``'s own namespace that were not defined in ``package``: a patch."""
    out = []
    for name, value in vars(cls).items():
        fn = getattr(value, "func", getattr(value, "fget", value))  # cached_property, property
        module = getattr(fn, "__module__", None)
        if callable(fn) and module is not None and not module.startswith(package):
            out.append(f"{cls.__name__}.{name} from {module}")
    return out


def test_importing_the_door_patches_nothing():
    """transformers' classes keep their own methods: the door is a subclass, not a patch."""
    import transformers
    import transformers.trainer

    import ndparallel.transformers as door

    assert door.Trainer is not transformers.Trainer and issubclass(door.Trainer, transformers.Trainer)
    assert transformers.trainer.Trainer is transformers.Trainer
    classes = (transformers.Trainer, transformers.TrainingArguments)
    assert [a for cls in classes for a in _foreign_attributes(cls, "transformers")] == []
    assert _foreign_attributes(door.Trainer, "transformers") == []  # not vacuous: the door's own are ...
    assert _foreign_attributes(door.TrainerDoor, "transformers")  # ... found
