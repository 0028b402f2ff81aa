"""`ndparallel train` with `adapter: qlora` + `load_in_4bit: true` (Axolotl's names): bad fields are one
line before launch, the dry run shows the 4-bit base, and a run on FSDP 2 with paged_adamw_8bit
writes a PEFT adapter and a model merged into the dequantised base that agree, checkpoints that
resume on one rank and export offline to the same merged model."""

from __future__ import annotations

import json
from pathlib import Path

import peft  # noqa: F401  (imported once before the ranks fork)
import pytest
import torch
import torch.nn as nn

from cli_helpers import run_cli
from ndparallel.axolotl import load_config
from ndparallel.testing import run_on_ranks

pytest.importorskip("torchao")
from torchao.quantization import to_nf4  # noqa: E402

QLORA = (
    "adapter: qlora\nload_in_4bit: true\nnf4_block_size: 32\nnf4_scaler_block_size: 4\n"
    "lora_target_linear: true\n"
)


def _yaml(tmp_path, text, base="tiny-llama"):
    p = tmp_path / "cfg.yaml"
    p.write_text(f"base_model: {base}\n" + text)
    return str(p)


@pytest.mark.parametrize(
    "text, fragment",
    [
        ("adapter: qlora\n", "adapter: qlora needs load_in_4bit: true"),
        ("load_in_4bit: true\n", "load_in_4bit: true needs adapter: qlora"),
        ("load_in_8bit: true\n", "an 8-bit base (load_in_8bit) is not supported: use adapter: qlora"),
        (
            QLORA + "bnb_config_kwargs: {bnb_4bit_quant_type: fp4}\n",
            "bnb_4bit_quant_type: 'fp4' is not supported",
        ),
        (
            QLORA + "bnb_config_kwargs: {bnb_4bit_blocksize: 32}\n",
            "bnb_config_kwargs: ['bnb_4bit_blocksize'] not supported",
        ),
        (
            "adapter: lora\nbnb_config_kwargs: {bnb_4bit_use_double_quant: true}\n",
            "bnb_config_kwargs set without",
        ),
        (
            QLORA + "tensor_parallel_size: 2\n",
            "with tensor_parallel_size > 1 is not supported (torchao's NF4",
        ),
        (QLORA + "dp_shard_size: 32\n", "cannot be split into 32 FSDP shards"),
        (
            "adapter: qlora\nload_in_4bit: true\n",
            "no linear layer of base_model='tiny-llama' holds whole NF4 groups",
        ),
        ("optimizer: lion_8bit\n", "optimizer: lion_8bit"),
    ],
)
def test_bad_qlora_config_is_one_line(tmp_path, capsys, text, fragment):
    code, _, err = run_cli(capsys, "train", _yaml(tmp_path, text), "--dry-run")
    assert code == 2, err
    assert fragment in err, err
    assert len(err.strip().splitlines()) == 1, err


def test_dry_run_shows_the_4bit_base_and_the_notes(tmp_path, capsys):
    text = (
        QLORA + "load_in_8bit: false\noptimizer: paged_adamw_8bit\nmerge_lora: true\n"
        "bnb_config_kwargs: {bnb_4bit_use_double_quant: true, bnb_4bit_compute_dtype: bfloat16}\n"
    )
    code, out, err = run_cli(capsys, "train", _yaml(tmp_path, text), "--dry-run")
    assert code == 0, err
    assert "quantised    : 4-bit NF4 (torchao) on 14 linears: 0.07M params" in out
    assert "base frozen in 4-bit NF4 (linears) + fp32" in out
    for note in (
        "optimizer: paged_adamw_8bit: -> torchao AdamW8bit; bitsandbytes' paging",
        "bnb_config_kwargs.bnb_4bit_compute_dtype: compute runs in the run's precision",
        "merge_lora: the adapter is merged into the dequantised NF4 base",
    ):
        assert note in out, out
    code, out, _ = run_cli(capsys, "train", _yaml(tmp_path, QLORA.replace("qlora", "lora", 1)), "--dry-run")
    assert code == 0 and "adapter: lora with load_in_4bit: true = adapter: qlora" in out
    # Axolotl's 8-bit LoRA: LoRA on the unquantised base, said in a note
    code, out, err = run_cli(
        capsys, "train", _yaml(tmp_path, "adapter: lora\nload_in_8bit: true\n"), "--dry-run"
    )
    assert code == 0 and "load_in_8bit: true -> LoRA on the base in bf16/fp32 (no 8-bit base here" in out, err


# ----------------------------------------------------------------------------- a real run
def _train(path: str, overrides: list[str]):
    from ndparallel.training.trainer import run_training

    torch.compiler.set_stance("force_eager")  # torchao's compiled AdamW step: ~10 s per shape here
    run_training(load_config(path, overrides))
    return True


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    from ndparallel.models.presets import preset_config

    root = tmp_path_factory.mktemp("qlora-train")
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(preset_config("tiny-llama", vocab_size=512)).save_pretrained(
        root / "base"
    )
    cfg = _yaml(
        root,
        QLORA + "tokenizer: builtin:stdlib\ntokenizer_vocab_size: 512\nsequence_len: 32\n"
        "datasets: [{path: 'builtin:stdlib', max_bytes: 200000}]\nmicro_batch_size: 2\n"
        "optimizer: paged_adamw_8bit\nlearning_rate: 5.0e-3\nlogging_steps: 1\nsave_steps: 2\n"
        "merge_lora: true\ndevice: cpu\n",
        base=root / "base",
    )
    common = [f"dataset_cache_dir={root / 'cache'}"]
    run_on_ranks(
        _train, 2, cfg, common + [f"output_dir={root / 'a'}", "max_steps=4", "dp_shard_size=2"], timeout_s=400
    )
    return {"root": root, "cfg": cfg, "common": common}


def _losses(out: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r and "step" in r}


def _nf4_base(root: Path, quantise: bool = True):
    """The base as the run computed with it: every linear but lm_head NF4-quantised and back."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(root / "base").float().eval()
    if quantise:
        with torch.no_grad():
            for m in model.modules():
                if isinstance(m, nn.Linear) and m is not model.lm_head:
                    m.weight.copy_(to_nf4(m.weight, 32, 4).get_original_weight())
    return model


def test_adapter_and_merged_model_are_the_trained_qlora_model(run):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    out = run["root"] / "a"
    ids = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        merged = AutoModelForCausalLM.from_pretrained(out / "merged").eval()(input_ids=ids).logits
        on_nf4 = PeftModel.from_pretrained(_nf4_base(run["root"]), out / "final").eval()(input_ids=ids).logits
        on_bf16 = (
            PeftModel.from_pretrained(_nf4_base(run["root"], quantise=False), out / "final")
            .eval()(input_ids=ids)
            .logits
        )
        base = _nf4_base(run["root"])(input_ids=ids).logits
    assert (merged - on_nf4).abs().max() <= 2e-5
    assert (merged - on_bf16).abs().max() > 1e-3  # negative control: the unquantised base is another model
    assert (merged - base).abs().max() > 1e-3  # the adapter learned something
    losses = _losses(out)
    assert sorted(losses) == [1, 2, 3, 4]


def test_offline_merge_of_the_checkpoint_equals_the_online_merge(run, capsys):
    from safetensors.torch import load_file

    out, merged = run["root"] / "a", run["root"] / "offline"
    code, stdout, err = run_cli(
        capsys, "export", out / "checkpoint-4", merged, "--merge", "--base", run["root"] / "base"
    )
    assert code == 0, err
    assert "merging into the NF4-quantised base" in stdout
    online, offline = load_file(out / "merged" / "model.safetensors"), load_file(merged / "model.safetensors")
    assert online.keys() == offline.keys()
    assert max((online[k].float() - offline[k].float()).abs().max().item() for k in online) <= 1e-6


def test_resume_on_one_rank(run):
    """checkpoint-2 of the FSDP 2 run, resumed on one rank (the same global batch): steps 3 and 4
    have the uninterrupted run's losses (the NF4 base re-read and re-quantised, adapters and 8-bit
    states restored)."""
    import shutil

    root = run["root"]
    shutil.copytree(root / "a", root / "b")
    shutil.rmtree(root / "b" / "checkpoint-4")
    (root / "b" / "metrics.jsonl").unlink()  # only the resumed steps' rows below
    run_on_ranks(
        _train,
        1,
        run["cfg"],
        run["common"]
        + [
            f"output_dir={root / 'b'}",
            "max_steps=4",
            "micro_batch_size=4",
            "merge_lora=false",
            f"resume_from_checkpoint={root / 'b' / 'checkpoint-2'}",
        ],
        timeout_s=400,
    )
    a, b = _losses(root / "a"), _losses(root / "b")
    assert sorted(b) == [3, 4], b
    for step in (3, 4):
        assert abs(a[step] - b[step]) <= 1e-5 * abs(a[step]), (a, b)
