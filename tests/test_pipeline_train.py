"""``ndparallel train`` with ``pipeline_parallel_size``: a YAML run on 8 ranks, PP 2 × FSDP 2 × TP 2,
evaluates as PP 1 does, checkpoints, resumes on PP 1 and exports an HF model equal to an uninterrupted PP 1
run; LoRA
checkpoints cross pipeline degrees both ways and the PP 2 adapter export is the one-process one; a
bad pipeline is refused before any rank starts."""

from __future__ import annotations

import sys
from pathlib import Path

import peft  # noqa: F401  (imported once before the ranks fork)
import pytest
import torch
import yaml

sys.path.insert(0, str(Path(__file__).parent))
import faults  # noqa: E402
from cli_helpers import train_on_forked_ranks  # noqa: E402

BASE = {
    "base_model": "tiny-llama-tied",  # tied embeddings: the first and last stage hold copies
    "overrides_of_model_config": {"num_hidden_layers": 4},
    "optimizer": "sgd",
    "learning_rate": 0.5,
    "lr_scheduler": "constant",
    "max_grad_norm": 1.0,
    "micro_batch_size": 1,
    "gradient_accumulation_steps": 2,
    "sequence_len": 32,
    "seed": 3,
    "datasets": [{"path": "builtin:stdlib", "max_bytes": 60000}],
    "val_set_size": 0.05,
    "eval_steps": 1,
}


def _write(path: Path, **fields) -> Path:
    path.write_text(yaml.safe_dump({**BASE, **fields}))
    return path


def _eval_losses(output_dir: Path) -> dict[int, float]:
    import json

    rows = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["eval_loss"] for r in rows if "eval_loss" in r}


def _weights(directory: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(directory / "model.safetensors"))


def test_pp2_fsdp2_tp2_checkpoint_resumes_on_pp1_and_exports_the_one_process_model(tmp_path):
    from transformers import AutoModelForCausalLM

    from ndparallel.cli import main

    pp = _write(
        tmp_path / "pp.yaml",
        pipeline_parallel_size=2,
        dp_shard_size=2,
        tensor_parallel_size=2,
        max_steps=2,
        save_steps=2,
        output_dir=str(tmp_path / "pp"),
    )
    run = train_on_forked_ranks(["train", pp])
    assert run.returncode == 0, run.stdout + run.stderr
    assert "PP 2 + FSDP 2 + TP 2 on 8 rank(s)" in run.stdout, run.stdout
    one = {"gradient_accumulation_steps": 4}  # the same 4 sequences a step as FSDP 2 x 2 micro-batches
    resumed = _write(
        tmp_path / "resume.yaml",
        **one,
        max_steps=3,
        output_dir=str(tmp_path / "resumed"),
        resume_from_checkpoint=str(tmp_path / "pp" / "checkpoint-2"),
    )
    straight = _write(tmp_path / "straight.yaml", **one, max_steps=3, output_dir=str(tmp_path / "straight"))
    assert main(["train", str(resumed)]) == 0  # one rank: in this process
    assert main(["train", str(straight)]) == 0
    pp_eval, one_eval = _eval_losses(tmp_path / "pp"), _eval_losses(tmp_path / "straight")
    assert sorted(pp_eval) == [1, 2] and all(
        abs(pp_eval[s] - one_eval[s]) <= 1e-5 * one_eval[s] for s in pp_eval
    )
    a, b = _weights(tmp_path / "resumed" / "final"), _weights(tmp_path / "straight" / "final")
    assert set(a) == set(b) and any(".layers.3." in k for k in a)
    assert max((a[k].float() - b[k].float()).abs().max().item() for k in a) <= 1e-5
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "pp" / "final")  # the PP run's own export
    assert model.config.num_hidden_layers == 4 and type(model).__name__ == "LlamaForCausalLM"


LORA = {"adapter": "lora", "lora_r": 4, "lora_alpha": 8, "lora_target_linear": True, "val_set_size": 0}


def _tensors(directory: Path, name: str) -> dict:
    from safetensors.torch import load_file

    return load_file(str(directory / name))


def test_lora_checkpoints_cross_pipeline_degrees_and_the_pp2_adapter_is_the_one_process_adapter(tmp_path):
    """LoRA: a PP 1 run's checkpoint resumes on PP 2 and the PP 2 checkpoint on PP 1, to the adapter
    of the uninterrupted PP 1 run; the PP 2 run's adapter (every stage's tensors) = the offline export
    of the PP 1 checkpoint of the same step, loads with PEFT and gives its merged model's logits."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from ndparallel.cli import main

    straight = _write(
        tmp_path / "straight.yaml", **LORA, max_steps=3, save_steps=1, output_dir=str(tmp_path / "one")
    )
    assert main(["train", str(straight)]) == 0  # one rank: in this process
    pp = _write(
        tmp_path / "pp.yaml",
        **LORA,
        pipeline_parallel_size=2,
        max_steps=2,
        save_steps=2,
        merge_lora=True,
        output_dir=str(tmp_path / "pp"),
        resume_from_checkpoint=str(tmp_path / "one" / "checkpoint-1"),
    )
    run = train_on_forked_ranks(["train", pp])
    assert run.returncode == 0, run.stdout + run.stderr
    back = _write(
        tmp_path / "back.yaml",
        **LORA,
        max_steps=3,
        output_dir=str(tmp_path / "back"),
        resume_from_checkpoint=str(tmp_path / "pp" / "checkpoint-2"),
    )
    assert main(["train", str(back)]) == 0
    weights = "adapter_model.safetensors"
    a, b = _tensors(tmp_path / "back" / "final", weights), _tensors(tmp_path / "one" / "final", weights)
    assert set(a) == set(b) and any(".layers.3." in k for k in a)
    assert max((a[k] - b[k]).abs().max().item() for k in a) <= 1e-6
    assert main(["export", str(tmp_path / "one" / "checkpoint-2"), str(tmp_path / "step2")]) == 0
    staged, offline = _tensors(tmp_path / "pp" / "final", weights), _tensors(tmp_path / "step2", weights)
    assert set(staged) == set(offline) == set(b)  # every stage's tensors, under PEFT's names
    assert max((staged[k] - offline[k]).abs().max().item() for k in staged) <= 1e-6
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "pp" / "merged").eval()
    torch.manual_seed(BASE["seed"])  # the preset's random base, as the run drew it
    base = AutoModelForCausalLM.from_config(merged.config).float().eval()
    ids = torch.randint(0, merged.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        plain = base(input_ids=ids).logits
        adapted = PeftModel.from_pretrained(base, tmp_path / "pp" / "final").eval()(input_ids=ids).logits
        assert (adapted - merged(input_ids=ids).logits).abs().max() <= 2e-5
    assert (adapted - plain).abs().max() > 1e-3  # the adapter learned something


@pytest.mark.parametrize(
    "on_nonfinite, max_steps, says", [("stop", 8, "from then on"), ("skip", 14, "in a row")]
)
def test_a_diverging_pipeline_stops_naming_the_step(tmp_path, on_nonfinite, max_steps, says):
    """The non-finite guard under PP 2 (the step's loss from the last stage, its norm over every
    stage, both on every rank): ``stop`` ends the run at the next check with one error naming the
    step, exit 1, and no checkpoint or final model of the diverged weights; ``skip`` skips each such
    step and, after more than 10 in a row, ends the same way (its checkpoints hold skipped, finite
    steps only)."""
    out = tmp_path / "run"
    config = _write(
        tmp_path / "nan.yaml",
        pipeline_parallel_size=2,
        learning_rate=1e12,
        max_grad_norm=None,
        max_steps=max_steps,
        save_steps=4 if on_nonfinite == "stop" else 100,
        logging_steps=1,
        val_set_size=0,
        on_nonfinite=on_nonfinite,
        output_dir=str(out),
    )
    run = train_on_forked_ranks(["train", config])
    errors = [line for line in run.stderr.splitlines() if line.startswith("ndparallel train: error:")]
    assert run.returncode == 1 and len(errors) == 1, run.stdout[-2000:] + run.stderr[-3000:]
    assert "not finite" in errors[0] and says in errors[0] and "Traceback" not in run.stderr, errors
    assert ("on_nonfinite: skip" in errors[0]) == (on_nonfinite == "stop")  # skip mode is not told to skip
    assert not (out / "final").exists() and not list(out.glob("checkpoint-*")), sorted(out.iterdir())


@pytest.mark.parametrize(
    "fields, words",
    [
        ({"pipeline_parallel_size": 2, "pipeline_schedule": "PipeDream"}, "is not a schedule"),
        ({"pipeline_parallel_size": 8}, "8 stages, but the model has 4 decoder layers"),
        ({"pipeline_parallel_size": 4}, "at least 4"),
        (
            {"pipeline_parallel_size": 2, **LORA, "lora_modules_to_save": ["embed_tokens", "lm_head"]},
            "lora_modules_to_save on tied embeddings",
        ),
        ({"pipeline_parallel_size": 2, "base_model": "tiny-qwen3-moe"}, "output_router_logits: false"),
        ({"pipeline_parallel_size": 2, "base_model": "tiny-mixtral"}, "this model is 'mixtral'"),
    ],
)
def test_bad_pipelines_fail_before_launch(tmp_path, capsys, fields, words):
    from ndparallel.cli import main

    config = _write(tmp_path / "bad.yaml", max_steps=1, output_dir=str(tmp_path / "out"), **fields)
    assert main(["train", str(config), "--dry-run"]) != 0
    err = capsys.readouterr().err
    assert words in err and "Traceback" not in err, err


def test_verify_proves_an_interleaved_pipeline_and_catches_unsummed_tied_gradients(capsys, monkeypatch):
    """``ndparallel verify`` on the pipeline example, cut to PP 2 × 2 virtual stages (the shrunk
    model gets a layer per stage): PASS; with the tied embedding copies left unsummed: FAIL."""
    from ndparallel.cli.commands import run_verify

    example = str(Path(__file__).resolve().parents[1] / "examples/cpu/pipeline.yaml")
    sets = [
        "--set=dp_shard_size=1",
        "--set=tensor_parallel_size=1",
        "--set=pipeline_schedule=Interleaved1F1B",
        "--set=base_model=tiny-llama-tied",
    ]
    assert run_verify([example, "--steps", "2", *sets]) == 0
    assert "PASS" in capsys.readouterr().out
    faults.unrecorded(monkeypatch)
    faults.unsummed_tied_grads(monkeypatch)
    assert run_verify([example, "--steps", "2", *sets]) == 1
    assert "FAIL" in capsys.readouterr().out
