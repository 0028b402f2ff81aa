"""Axolotl's keys for the checkpoint formats the loader reads (axolotl/checkpoint.py):
``model_quantization_config: Mxfp4Config`` + ``{dequantize: true}`` (gpt-oss) and
``llama4_linearized_experts: true``, translated with a note or refused with the fix; Axolotl's own
gpt-oss and Llama 4 examples pass ``--dry-run`` on tiny MXFP4 / linearized checkpoints, and a run
from the MXFP4 one trains on 2 FSDP ranks and writes a plain model transformers loads."""

from __future__ import annotations

import json

import pytest
import torch

from axolotl_stand_ins import FIXTURES
from cli_helpers import run_cli
from ndparallel.axolotl import load_config, own_keys
from ndparallel.axolotl.checkpoint import LINEARIZED_LORA_FIX, MXFP4_FIX
from ndparallel.axolotl.translate import translate
from ndparallel.testing import run_on_ranks
from test_checkpoint_formats import gpt_oss, llama4  # noqa: F401 - the tiny checkpoints (fixtures)

MX = {"model_quantization_config": "Mxfp4Config"}


@pytest.mark.parametrize(
    "raw, problem",
    [
        ({**MX, "model_quantization_config_kwargs": {"dequantize": True}}, None),
        ({"model_quantization_config_kwargs": {"dequantize": True}, **MX}, None),  # either order
        ({**MX, "model_quantization_config_kwargs": {"dequantize": False}}, MXFP4_FIX),
        (MX, MXFP4_FIX),
        (
            {**MX, "model_quantization_config_kwargs": {"dequantize": True, "modules_to_not_convert": ["x"]}},
            "only dequantize: true is understood",
        ),
        ({"model_quantization_config": "FineGrainedFP8Config"}, "only Mxfp4Config"),
        ({"model_quantization_config_kwargs": {"dequantize": True}}, "without model_quantization_config"),
        ({"llama4_linearized_experts": True}, None),
        (
            {
                "llama4_linearized_experts": True,
                "lora_target_modules": ["self_attn.q_proj", "experts.gate_projs.[0-9]+$"],
            },
            LINEARIZED_LORA_FIX,
        ),
        ({"llama4_linearized_experts": False, "model_quantization_config": None}, None),
    ],
)
def test_translation_notes_or_refuses_with_the_fix(raw, problem):
    t = translate(raw, own_keys())
    if problem is None:
        assert t.problems == []
        assert all(k not in t.data or t.data[k] is None for k in raw if k != "lora_target_modules")
        mine = [
            n for n in t.notes if n.startswith(("model_quantization_config", "llama4_linearized_experts"))
        ]
        assert len(mine) == sum(bool(v) for k, v in raw.items() if k != "model_quantization_config_kwargs"), (
            mine
        )
    else:
        assert len(t.problems) == 1 and problem in t.problems[0], t.problems


def test_axolotl_examples_dry_run_on_the_converted_checkpoints(gpt_oss, llama4, capsys):  # noqa: F811
    example = FIXTURES / "examples" / "gpt-oss" / "gpt-oss-20b-fft-fsdp2.yaml"
    code, out, err = run_cli(capsys, "train", example, "--dry-run", "--set", f"base_model={gpt_oss[1]}")
    assert code == 0, err
    assert "MXFP4 expert weights (*_blocks + *_scales) are dequantised on load" in out
    example = FIXTURES / "examples" / "llama-4" / "scout-qlora-flexattn-fsdp2.yaml"
    sets = [f"base_model={llama4[1]}", "nf4_block_size=2", "nf4_scaler_block_size=2"]
    code, out, err = run_cli(capsys, "train", example, "--dry-run", *[a for s in sets for a in ("--set", s)])
    assert code == 0, err
    assert "llama4_linearized_experts: true -> the checkpoint's per-expert linears" in out
    # dequantize: false is refused before launch, naming the fix
    code, _, err = run_cli(
        capsys,
        "train",
        FIXTURES / "examples" / "gpt-oss" / "gpt-oss-20b-fft-fsdp2.yaml",
        "--dry-run",
        "--set",
        f"base_model={gpt_oss[1]}",
        "--set",
        "model_quantization_config_kwargs.dequantize=false",
    )
    assert code == 2 and "set model_quantization_config_kwargs: {dequantize: true}" in err, err


def _train(path: str, overrides: list[str]) -> bool:
    from ndparallel.training.trainer import run_training

    run_training(load_config(path, overrides))
    return True


RUNS = {
    "gpt_oss": (
        "model_quantization_config: Mxfp4Config\nmodel_quantization_config_kwargs: {dequantize: true}\n"
        "gradient_checkpointing: true\n"
    ),  # the layers wrapped before the experts are read
    "llama4": (
        "llama4_linearized_experts: true\nadapter: qlora\nload_in_4bit: true\nlora_r: 4\nlora_alpha: 8\n"
        "lora_target_modules: [self_attn.q_proj, self_attn.v_proj, shared_expert.gate_proj]\n"
        "nf4_block_size: 2\nnf4_scaler_block_size: 2\n"
    ),
}


@pytest.mark.parametrize("fmt", sorted(RUNS))
def test_run_from_the_converted_checkpoint_trains_on_fsdp_and_saves(fmt, request, tmp_path):
    """gpt-oss MXFP4, full fine-tune; Llama 4 linearized, QLoRA as Axolotl's examples: 2 FSDP ranks,
    the output loads with transformers (plain layout, no quantization_config) or PEFT."""
    from transformers import AutoModelForCausalLM

    base = request.getfixturevalue(fmt)[1]
    cfg = tmp_path / "run.yaml"
    cfg.write_text(
        f"base_model: {base}\n{RUNS[fmt]}"
        "tokenizer: builtin:stdlib\ntokenizer_vocab_size: 512\nsequence_len: 32\n"
        "datasets: [{path: 'builtin:stdlib', max_bytes: 100000}]\nmicro_batch_size: 2\n"
        "optimizer: sgd\nlearning_rate: 0.1\nlogging_steps: 1\nmax_steps: 2\ndevice: cpu\n"
        f"dataset_cache_dir: {tmp_path / 'cache'}\noutput_dir: {tmp_path / 'out'}\n"
    )
    run_on_ranks(_train, 2, str(cfg), ["dp_shard_size=2"], timeout_s=400)
    final = tmp_path / "out" / "final"
    rows = [json.loads(x) for x in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert sorted(r["step"] for r in rows if "loss" in r) == [1, 2]
    if fmt == "gpt_oss":
        assert "quantization_config" not in json.loads((final / "config.json").read_text())
        model = AutoModelForCausalLM.from_pretrained(final)
        assert model.model.layers[0].mlp.experts.gate_up_proj.dtype in (torch.float32, torch.bfloat16)
    else:
        from peft import PeftModel

        base_model = AutoModelForCausalLM.from_pretrained(request.getfixturevalue(fmt)[0])
        PeftModel.from_pretrained(base_model, final)  # the adapter fits transformers' Llama 4
