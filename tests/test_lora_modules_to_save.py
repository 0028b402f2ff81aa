"""LoRA's ``modules_to_save`` (Axolotl's ``lora_modules_to_save``: embeddings / LM head trained in
full beside the adapters): every layout trains the same model as one process (fp32, SGD), tied
embeddings stay tied, the saved PEFT adapter holds the trained modules and reproduces the trained
model's logits (PEFT's loader, the merged export, the offline merge), QLoRA leaves them unquantised,
tensor parallel is refused by name."""

from __future__ import annotations

import peft  # noqa: F401  (imported once before the ranks fork)
import pytest
import torch

from cli_helpers import run_cli
from lora_roundtrip import PROBE, continue_from, save_base, train_and_save
from ndparallel.models.presets import preset_config
from ndparallel.testing import run_on_ranks
from ndparallel.tools.agreement import assert_matches, one_process_reference
from ndparallel.tools.equivalence import (
    TrainSetup,
    build_model,
    train_under_layout,
)

SAVE = ["embed_tokens", "lm_head"]
LORA = dict(r=4, alpha=8, target_modules=["q_proj", "v_proj"], modules_to_save=SAVE)


def _setup(preset: str, **lora) -> TrainSetup:
    return TrainSetup(
        preset_config(preset),
        steps=3,
        global_micro_batch=4,
        seq_len=32,
        max_grad_norm=1.0,
        optimizer="sgd",
        lr=0.5,
        adapter={**LORA, **lora},
    )


def _reference(setup: TrainSetup):
    return one_process_reference(setup)


def _initial(setup: TrainSetup) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in build_model(setup).state_dict().items()}


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-llama-tied"])
@pytest.mark.parametrize(
    "layout, world",
    [({"dp_shard_size": 2}, 2), ({"dp_replicate_size": 2, "dp_shard_size": 2}, 4)],
    ids=["fsdp2", "dp2xfsdp2"],
)
def test_layouts_train_the_saved_modules_as_one_process(preset, layout, world):
    setup = _setup(preset)
    got = run_on_ranks(train_under_layout, world, setup, layout, timeout_s=400)[0]
    assert_matches(_reference(setup), got)
    start = _initial(setup)
    copies = [k for k in start if ".modules_to_save.default." in k]
    originals = [k for k in start if ".original_module." in k]
    assert len(copies) == len(originals) == 2, sorted(start)
    for k in copies:  # trained in full: every row of the vocabulary that was seen moved
        assert (got.params[k] - start[k]).abs().max() > 1e-3, k
    for k in originals:
        assert torch.equal(got.params[k], start[k]), k
    if preset.endswith("-tied"):  # one trained tensor is both the embedding and the LM head
        emb, head = (next(k for k in copies if part in k) for part in ("embed_tokens", "lm_head"))
        assert torch.equal(got.params[emb], got.params[head])


def test_cp2():
    setup = _setup("tiny-llama")
    got = run_on_ranks(train_under_layout, 2, setup, {"cp_size": 2}, timeout_s=400)[0]
    assert_matches(_reference(setup), got, compared=("loss_rel", "param_abs"))


def test_without_the_key_the_modules_stay_frozen():
    """Negative control: the same run without modules_to_save leaves the embedding and head alone."""
    setup = _setup("tiny-llama", modules_to_save=None)
    ref = _reference(setup).result
    start = _initial(setup)
    for k in ("base_model.model.model.embed_tokens.weight", "base_model.model.lm_head.weight"):
        assert torch.equal(ref.params[k], start[k]), k
    assert _reference(_setup("tiny-llama")).result.losses[-1] != ref.losses[-1]


def test_saved_adapter_holds_the_trained_modules_and_reproduces_the_model(tmp_path):
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from ndparallel.checkpoint.adapter_merge import merge_adapter_files

    base_dir, out = str(tmp_path / "base"), tmp_path / "out"
    run_on_ranks(save_base, 1, base_dir, preset_config("tiny-llama-tied"))
    trained = run_on_ranks(train_and_save, 2, _setup("tiny-llama-tied"), base_dir, str(out), timeout_s=400)[0]
    saved = load_file(str(out / "adapter" / "adapter_model.safetensors"))
    base = load_file(f"{base_dir}/model.safetensors")
    emb = saved["base_model.model.model.embed_tokens.weight"]
    assert emb.shape == base["model.embed_tokens.weight"].shape
    assert (emb - base["model.embed_tokens.weight"]).abs().max() > 1e-3  # the trained module, whole

    def logits(model):
        with torch.no_grad():
            return model.eval()(input_ids=PROBE).logits

    peft_model = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(base_dir), str(out / "adapter")
    )
    merge_adapter_files(out / "adapter", out / "offline", base=base_dir)
    untouched = logits(AutoModelForCausalLM.from_pretrained(base_dir))
    assert (untouched - trained).abs().max() > 1e-2  # training changed the model
    for name, model in (
        ("peft", peft_model),
        ("merged", AutoModelForCausalLM.from_pretrained(out / "merged")),
        ("offline merge", AutoModelForCausalLM.from_pretrained(out / "offline")),
    ):
        assert (logits(model) - trained).abs().max() <= 2e-5, name
    resumed = run_on_ranks(continue_from, 2, base_dir, str(out / "adapter"), timeout_s=400)[0]
    assert (resumed - trained).abs().max() <= 2e-5  # lora_model_dir: the run continues from it


def test_tensor_parallel_is_refused_in_python_too():
    from ndparallel.runtime.multirank import RankFailure

    with pytest.raises(RankFailure, match="LoRA's modules_to_save .* are trained whole"):
        run_on_ranks(train_under_layout, 2, _setup("tiny-llama"), {"tp_size": 2}, timeout_s=200)


def test_qlora_leaves_the_saved_modules_unquantised():
    from transformers import AutoModelForCausalLM

    from ndparallel.models.adapters import apply_adapter, lora_config
    from ndparallel.models.quantized import NF4Config, quantized_linears

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(preset_config("tiny-llama"))
    model = apply_adapter(model, lora_config(r=4, target_modules=["q_proj"], modules_to_save=["lm_head"]))
    names, _ = quantized_linears(model, NF4Config(block_size=32, scaler_block_size=4))
    assert names and not [n for n in names if "lm_head" in n], names


@pytest.mark.parametrize(
    "extra, fragment",
    [
        (
            "tensor_parallel_size: 2\n",
            "tensor_parallel_size=2: LoRA's modules_to_save (embed_tokens, lm_head) are trained whole",
        ),
        ("", "on 2 layers (q_proj, trained whole: embed_tokens, lm_head)"),
    ],
)
def test_cli(tmp_path, capsys, extra, fragment):
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(
        "base_model: tiny-llama\nadapter: lora\nlora_target_modules: [q_proj]\n"
        f"lora_modules_to_save: [embed_tokens, lm_head]\n{extra}"
    )
    code, out, err = run_cli(capsys, "train", str(cfg), "--dry-run")
    assert (code == 2) == bool(extra), err
    assert fragment in (err if extra else out), (out, err)
    if extra:
        assert len(err.strip().splitlines()) == 1, err


def test_a_bf16_base_keeps_fp32_trained_copies():
    """As PEFT keeps the adapters: the trained copies are fp32 master weights, the originals bf16."""
    from transformers import AutoModelForCausalLM

    from ndparallel.models.adapters import apply_adapter, lora_config

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(preset_config("tiny-llama-tied"), dtype=torch.bfloat16)
    model = apply_adapter(model, lora_config(r=4, target_modules=["q_proj"], modules_to_save=SAVE))
    got = {
        ("copy" if ".modules_to_save." in n else "original", p.dtype)
        for n, p in model.named_parameters(remove_duplicate=False)
        if "embed_tokens" in n or "lm_head" in n
    }
    assert got == {("original", torch.bfloat16), ("copy", torch.float32)}, got
    inner = model.get_base_model()
    assert (
        inner.lm_head.modules_to_save["default"].weight
        is inner.model.embed_tokens.modules_to_save["default"].weight
    )
