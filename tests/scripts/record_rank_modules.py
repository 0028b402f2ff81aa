"""Record the modules a forked test rank imports that the pytest process has not: ``tests/conftest.py``
imports them once per test worker, so that no rank of any test imports them again.

    python tests/scripts/record_rank_modules.py      # rewrites tests/rank_modules.txt (~1 min)

Why: a rank forked by ``run_on_ranks`` inherits the modules its parent has imported; everything
else (ndparallel's strategy modules, FSDP, DTensor's parallel styles, DCP, PEFT, the model
classes, and what they pull in: scipy, sympy, ...) it imports itself — ~2,000 modules, ~1.8 s of
CPU per rank, paid again by every rank of every test. Imported once in the parent, a 2-rank FSDP
body costs 0.15 s of CPU per rank instead of 1.9 s. The list is a cache: a stale one makes the
suite slower, never different (a module that no longer exists is skipped).

The bodies below are the suite's common rank work: FSDP, TP + sequence parallel, CP, expert
parallel, pipeline parallel, LoRA, a checkpoint saved and an HF export, one ``ndparallel train``
rank (data, tokenizer, trainer), and the Trainer door's scripts (transformers' ``Trainer`` with a
checkpoint and a tracker, TRL's SFT and DPO with LoRA).
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(TESTS))

import torch  # noqa: E402,F401  (what conftest imports before anything else)
import transformers  # noqa: E402,F401

BEFORE = list(sys.modules)


def _new_modules() -> list[str]:
    known = set(BEFORE)
    return [m for m in sys.modules if m not in known]


def _train(setup, layout) -> list[str]:
    from ndparallel.tools.equivalence import train_under_layout

    train_under_layout(setup, layout)
    return _new_modules()


def _checkpoint_and_export(out: str) -> list[str]:
    from ndparallel import Accelerator, ParallelismConfig
    from ndparallel.models.presets import preset_config

    acc = Accelerator(parallelism_config=ParallelismConfig(dp_shard_size=2))
    model = acc.prepare(transformers.AutoModelForCausalLM.from_config(preset_config("tiny-llama")))
    acc.save_state(f"{out}/state")
    acc.save_model(model, f"{out}/model")
    return _new_modules()


def _trainer_door(model_dir: str, out: str) -> list[str]:
    """One step of each Trainer door script (tests/trainer_scripts/)."""
    import warnings

    from trainer_scripts import trainer_features, trl_dpo, trl_sft

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        base = ["--model-name", model_dir, "--max-steps", "1"]
        trainer_features.main(
            [*base, "--save-dir", f"{out}/f", "--save-steps", "1", "--report-to", "tensorboard"]
        )
        trl_sft.main([*base, "--save-dir", f"{out}/s", "--padding-free"])
        trl_dpo.main([*base, "--save-dir", f"{out}/d", "--lora"])
    return _new_modules()


def main() -> int:

    from ndparallel.models.presets import preset_config
    from ndparallel.parallel.options import PipelineOptions, TPOptions
    from ndparallel.testing import run_on_ranks
    from ndparallel.tools.equivalence import TrainSetup

    base = dict(steps=1, global_micro_batch=4, seq_len=32, optimizer="sgd", lr=0.5)
    llama = preset_config("tiny-llama")
    cases = [
        (TrainSetup(llama, **base), {"dp_shard_size": 2}),
        (
            TrainSetup(llama, **base, parallel_kwargs={"tp_options": TPOptions(sequence_parallel=True)}),
            {"tp_size": 2},
        ),
        (TrainSetup(llama, **base), {"cp_size": 2}),
        (TrainSetup(preset_config("tiny-qwen3-moe"), **base), {"dp_shard_size": 2, "ep_size": 2}),
        (
            TrainSetup(
                preset_config("tiny-llama", num_hidden_layers=4),
                **dict(base, grad_accum=2),
                parallel_kwargs={"pipeline_options": PipelineOptions(schedule="1F1B")},
            ),
            {"pp_size": 2},
        ),
        (TrainSetup(llama, **base, adapter=dict(r=2, alpha=4, target_linear=True)), {"dp_shard_size": 2}),
    ]
    modules: dict[str, None] = {}
    for setup, layout in cases:
        modules.update(dict.fromkeys(run_on_ranks(_train, 2, setup, layout)[0]))
    with tempfile.TemporaryDirectory() as tmp:
        modules.update(dict.fromkeys(run_on_ranks(_checkpoint_and_export, 2, tmp)[0]))
        modules.update(dict.fromkeys(_train_command_rank(Path(tmp))))
        from sft_fixtures import tiny_llama_dir

        model_dir = str(tiny_llama_dir(Path(tmp) / "tiny-llama"))
        env = {"PARALLELISM_CONFIG_DP_SHARD_SIZE": "2", "HF_HUB_OFFLINE": "1"}
        modules.update(dict.fromkeys(run_on_ranks(_trainer_door, 2, model_dir, tmp, env=env)[0]))
    names = [m for m in modules if not m.startswith(("__main__", "__mp_main__")) and "._C" not in m]
    out = TESTS / "rank_modules.txt"
    out.write_text("\n".join(names) + "\n")
    print(f"{len(names)} modules -> {out}")
    return 0


def _train_command_rank(tmp: Path) -> list[str]:
    """The modules of one `ndparallel train` rank, forked as the CLI tests fork theirs."""
    import os

    from cli_helpers import train_on_forked_ranks

    listing = tmp / "modules.txt"
    os.environ["NDPARALLEL_RECORD_MODULES"] = str(listing)  # read by the rank hook below
    proc = train_on_forked_ranks(
        [
            "train",
            "--set",
            "base_model=tiny-llama",
            "--set",
            "tokenizer_vocab_size=512",
            "--set",
            "sequence_len=32",
            "--set",
            "max_steps=1",
            "--set",
            "save_steps=null",
            "--set",
            "datasets=[{path: 'builtin:stdlib', max_bytes: 20000}]",
            "--set",
            f"output_dir={tmp / 'run'}",
            "--set",
            f"dataset_cache_dir={tmp / 'cache'}",
            "--set",
            "dp_shard_size=2",
            "--nproc-per-node",
            "2",
        ]
    )
    os.environ.pop("NDPARALLEL_RECORD_MODULES")
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-3000:])
    known = set(BEFORE)
    return [m for m in listing.read_text().split() if m not in known] if listing.is_file() else []


if __name__ == "__main__":
    sys.exit(main())
