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


def _run(name: str, recorded: dict, run: str, layout: dict, model_dir, out, *extra: str) -> list[dict]:
    """The script's run ``run`` on ``layout``, the per-device batch divided over its dp ranks (the
    peer's global batch), with the script's arguments ``extra``; rank 0's log history."""
    own = list(recorded["run_argv"][run])
    dp = layout.get("dp_replicate_size", 1) * layout.get("dp_shard_size", 1)
    at = own.index("--per-device-batch-size") + 1
    own[at] = str(int(own[at]) // dp)
    world = 1
    for size in layout.values():
        world *= size
    env = {f"PARALLELISM_CONFIG_{k.upper()}": str(v) for k, v in layout.items()} | QUIET_HUB
    argv = ["--model-name", str(model_dir), "--save-dir", str(out), *recorded["argv"], *own, *extra]
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
    "run, layout",
    [("full", CP2), ("full", TP2), ("lora", FSDP2_TP2)],
    ids=["reference-model-cp2", "reference-model-tp2", "lora-fsdp2xtp2"],
)
def test_dpo_equals_trl(run, layout, model_dir, model_config, tmp_path):
    """(The LoRA run also saves its model: a PEFT adapter directory, ``_load_adapter``.)"""
    extra = ["--save-model"] if run == "lora" else []
    history = _run("trl_dpo", DPO, run, layout, model_dir, tmp_path, *extra)
    assert_matches(peer_reference(DPO, run, model_config), steps_of(history))
    margins = peer_reference(DPO, run, model_config, metric="rewards/margins")
    assert_matches(margins, logged(history, "rewards/margins"), compared=("loss_rel",))
    if run == "lora":
        adapter = run_on_ranks(_load_adapter, 1, str(model_dir), str(tmp_path), env=QUIET_HUB)[0]
        assert adapter["files"] == [True, False], adapter  # an adapter directory, no full model
        assert adapter["lora"] == 2 * 2 * 2  # A and B of q_proj and v_proj in both layers
        assert adapter["trained_b"] and adapter["changes_logits"], adapter  # B starts at zero
        assert adapter["from_pretrained_equal"], adapter  # AutoModel...from_pretrained(dir) loads it too


def _load_adapter(model_dir: str, saved: str) -> dict:
    """What ``save_model`` of a LoRA policy wrote, loaded as TRL users load it: ``PeftModel`` onto the
    base model, and ``AutoModelForCausalLM.from_pretrained`` of the directory (transformers reads the
    base from ``adapter_config.json``); in a rank: the test process computes nothing, so its forks stay
    safe."""
    from pathlib import Path

    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    saved = Path(saved)
    base = AutoModelForCausalLM.from_pretrained(model_dir)
    ids = torch.arange(1, 17).unsqueeze(0)
    with torch.no_grad():
        before = base(input_ids=ids).logits
        adapted = PeftModel.from_pretrained(base, saved)
        after = adapted(input_ids=ids).logits
        auto = AutoModelForCausalLM.from_pretrained(saved)(input_ids=ids).logits  # base + adapter
    lora = {n: p for n, p in adapted.named_parameters() if "lora_" in n}
    return {
        "files": [(saved / "adapter_config.json").is_file(), bool(list(saved.glob("model*.safetensors")))],
        "lora": len(lora),
        "trained_b": all(bool(p.abs().sum() > 0) for n, p in lora.items() if "lora_B" in n),
        "changes_logits": not torch.allclose(before, after),
        "from_pretrained_equal": torch.equal(auto, after),
    }


def test_the_trl_classes_are_trls_with_the_door_under_them():
    import trl

    import ndparallel.trl as door
    from ndparallel.transformers import TrainerDoor

    for ours, theirs in ((door.SFTTrainer, trl.SFTTrainer), (door.DPOTrainer, trl.DPOTrainer)):
        assert issubclass(ours, theirs) and issubclass(ours, TrainerDoor)
        assert ours.__mro__.index(theirs) < ours.__mro__.index(TrainerDoor)  # TRL's overrides run first
    assert issubclass(door.SFTConfig, trl.SFTConfig) and issubclass(door.DPOConfig, trl.DPOConfig)
    assert trl.SFTTrainer.compute_loss.__module__.startswith("trl.")  # nothing patched


@pytest.mark.filterwarnings("ignore:`gradient_checkpointing` is deprecated:FutureWarning")  # TRL's own
def test_the_configs_pickle_as_transformers_saves_them():
    """``training_args.bin`` (``save_model``, checkpoints) is the pickled arguments: a class made by
    ``parallel_arguments`` comes back as itself, its fields kept."""
    import pickle

    from ndparallel.trl import DPOConfig

    config = DPOConfig("out", use_cpu=True, report_to="none", beta=0.25)
    again = pickle.loads(pickle.dumps(config))
    assert type(again) is DPOConfig and again.beta == 0.25 and again.to_dict() == config.to_dict()


def _whole_sequence_calls(cp_rank: int):
    """The hooks of a CP 2 layout's rank ``cp_rank`` (their split needs no process group)."""
    from types import SimpleNamespace

    from ndparallel.layout.dims import ParallelDims
    from ndparallel.parallel.options import CPOptions, TPOptions
    from ndparallel.transformers.door_whole_sequences import WholeSequenceCalls

    engine = SimpleNamespace(dims=ParallelDims(cp=2), options=SimpleNamespace(cp=CPOptions(), tp=TPOptions()))
    group = SimpleNamespace(get_group=lambda: "the cp group")
    return WholeSequenceCalls(
        SimpleNamespace(engine=engine, rank_in=lambda dim: cp_rank, mesh=lambda dim: group)
    )


def test_a_whole_sequence_call_is_split_as_one_process_sees_it():
    """A right-padded preference batch (TRL's collator): padded to 2·cp chunks, labels shifted before
    the split and ignored where the input is padding, global positions; this rank's chunks 1 and 2."""
    import torch

    ids = torch.tensor([[5, 6, 7, 8, 9, 0], [5, 6, 7, 0, 0, 0]])
    mask = (ids != 0).long()
    args, kwargs = _whole_sequence_calls(cp_rank=1).split(
        None, (), {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(ids < 7, -100)}
    )
    assert args == () and set(kwargs) == {"input_ids", "position_ids", "shift_labels"}
    assert kwargs["input_ids"].tolist() == [[7, 8, 9, 0], [7, 0, 0, 0]]  # positions 2, 3, 4, 5
    assert kwargs["position_ids"].tolist() == [[2, 3, 4, 5]] * 2
    assert kwargs["shift_labels"].tolist() == [[8, 9, -100, -100], [-100, -100, -100, -100]]


@pytest.mark.parametrize(
    "inputs, fragment",
    [
        ({"attention_mask": [[0, 1, 1, 1]]}, "padding_side='right'"),
        ({"completion_mask": [[0, 1, 1, 1]]}, "'completion_mask'"),
    ],
)
def test_what_a_whole_sequence_call_cannot_split_is_refused(inputs, fragment):
    import torch

    kwargs = {"input_ids": torch.tensor([[4, 5, 6, 7]])} | {k: torch.tensor(v) for k, v in inputs.items()}
    with pytest.raises(ValueError, match=fragment) as raised:
        _whole_sequence_calls(cp_rank=0).split(None, (), kwargs)
    assert "\n" not in str(raised.value)
