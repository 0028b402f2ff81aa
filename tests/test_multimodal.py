"""Multimodal checkpoints (text decoder + vision / audio towers) train on text as their
``*ForConditionalGeneration`` class, as Axolotl trains them: tiny Gemma 3 / Mistral 3 / Voxtral /
Qwen 3.5 / Gemma 4 checkpoints written by ``save_pretrained`` load sharded, train 2 SGD steps on
packed rows under FSDP 2, TP 2 and CP 2 equal to one process (``tools.agreement``'s bounds; Gemma 4's
× sqrt(head_dim): docs/families.md), Axolotl's ``model.language_model...`` LoRA
regex adapts exactly the language model's projections, the export loads with transformers, and
what fails under TP is refused before launch."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import transformers

from ndparallel.testing import run_on_ranks
from ndparallel.tools.agreement import assert_matches, reference_in_rank
from ndparallel.tools.equivalence import TrainSetup, train_under_layout

sys.path.insert(0, str(Path(__file__).resolve().parent))
from axolotl_stand_ins import MULTIMODAL, multimodal_model  # noqa: E402

AXOLOTL_REGEX = r"model.language_model.layers.[\d]+.(mlp|self_attn).(up|down|gate|q|k|v|o)_proj"


def save_multimodal(root: Path, model_type: str) -> Path:
    torch.manual_seed(0)
    multimodal_model(model_type).save_pretrained(root / model_type)  # config.json names the class
    return root / model_type


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("multimodal")
    return {mt: str(save_multimodal(root, mt)) for mt in MULTIMODAL}


def _setup(path: str) -> TrainSetup:
    config = transformers.AutoConfig.from_pretrained(path).get_text_config()
    return TrainSetup(
        config,
        steps=2,
        global_micro_batch=2,
        seq_len=16,
        optimizer="sgd",
        lr=0.1,
        max_grad_norm=1.0,
        packed_documents=True,
        model_dir=path,
    )


def _train_all(setups: dict, layout: dict | None) -> dict:
    return {name: train_under_layout(setup, layout) for name, setup in setups.items()}


def _references(setups: dict) -> dict:
    """On one rank: each checkpoint's one-process run with its measured bounds (tools.agreement)."""
    return {name: reference_in_rank(setup) for name, setup in setups.items()}


def test_multimodal_class_and_names(saved):
    """The class the checkpoint names is built (also where AutoModelForCausalLM has none or a text
    class), its parameters keep the checkpoint's names; Axolotl's regex adapts the 7 projections of
    each language-model layer and nothing in the towers."""
    from ndparallel.models.adapters import apply_adapter, is_lora_layer, lora_config
    from ndparallel.models.loading import build_on_meta

    for mt, path in saved.items():
        model, _, _ = build_on_meta(Path(path), torch.float32, None, False)
        assert type(model).__name__.endswith("ForConditionalGeneration"), mt
        assert any(n.startswith("model.language_model.layers.0.") for n, _ in model.named_parameters()), mt
        adapted = [
            n
            for n, m in apply_adapter(model, lora_config(target_modules=AXOLOTL_REGEX)).named_modules()
            if is_lora_layer(m)
        ]
        expected = 7 * 2 - (1 if mt == "qwen3_5" else 0) * 4  # qwen3_5: layer 0 is linear attention
        assert len(adapted) == expected and all(".language_model.layers." in n for n in adapted), (
            mt,
            adapted,
        )
        from ndparallel.plan.models import load_model_spec

        spec = load_model_spec(path)  # the planner sizes the text model (config.json: text_config)
        assert (spec.hidden, spec.layers, spec.vocab) == (64, 2, 512), mt


def test_fsdp_tp_cp_equal_one_process(saved):
    setups = {mt: _setup(p) for mt, p in saved.items()}
    ref = run_on_ranks(_references, 1, setups, timeout_s=300)[0]
    fsdp = run_on_ranks(_train_all, 2, setups, {"dp_shard_size": 2}, timeout_s=300)[0]
    cp_setups = {mt: s for mt, s in setups.items() if mt != "qwen3_5"}  # linear attention: refused under CP
    cp = run_on_ranks(_train_all, 2, cp_setups, {"cp_size": 2}, timeout_s=300)[0]
    tp_setups = {
        mt: s for mt, s in setups.items() if mt not in ("qwen3_5", "gemma4")
    }  # refused under TP (below)
    tp = run_on_ranks(_train_all, 2, tp_setups, {"tp_size": 2}, timeout_s=300)[0]
    assert set(tp) == {"gemma3", "mistral3", "voxtral"}
    for name, runs in (("fsdp", fsdp), ("cp", cp), ("tp", tp)):
        for mt, run in runs.items():
            print(name, mt, assert_matches(ref[mt], run))  # Gemma 4: × sqrt(head_dim), derived
    assert {"gemma4"} <= set(fsdp) & set(cp)
    # the towers got no gradient: they end as loaded
    loaded = transformers.AutoModelForImageTextToText.from_pretrained(saved["mistral3"]).state_dict()
    trained = ref["mistral3"].result.params
    towers = [k for k in trained if "vision_tower" in k]
    assert towers and all(torch.equal(trained[k], loaded[k]) for k in towers)
    assert not torch.equal(trained["lm_head.weight"], loaded["lm_head.weight"])


def _load_and_export(paths: dict, out_root: str) -> dict:
    from ndparallel import Accelerator, ParallelismConfig
    from ndparallel.tools.equivalence import full_parameters

    acc = Accelerator(ParallelismConfig(dp_shard_size=2))
    out = {}
    for mt, path in paths.items():
        model = acc.load_model(path)
        out[mt] = full_parameters(model)
        acc.save_model(model, f"{out_root}/{mt}")
    return out if acc.is_main_process else {}


def test_export_loads_with_transformers(saved, tmp_path):
    paths = {mt: saved[mt] for mt in ("mistral3", "voxtral")}
    got = run_on_ranks(_load_and_export, 2, paths, str(tmp_path), timeout_s=300)[0]
    for mt, path in paths.items():
        cls = getattr(transformers, transformers.AutoConfig.from_pretrained(path).architectures[0])
        again = cls.from_pretrained(tmp_path / mt).state_dict()
        ref = cls.from_pretrained(path).state_dict()
        assert set(again) == set(ref) and all(torch.equal(again[k], ref[k]) for k in ref), mt
        assert all(torch.equal(got[mt][k], ref[k]) for k in got[mt]), mt


def test_tensor_parallel_refused_before_launch_where_it_fails(saved):
    from ndparallel.parallel.tp.validate import validate_tensor_parallel

    for mt in ("gemma4", "qwen3_5"):
        with pytest.raises(ValueError, match="multimodal checkpoint.*tensor_parallel_size > 1"):
            validate_tensor_parallel(transformers.AutoConfig.from_pretrained(saved[mt]), 2)
    validate_tensor_parallel(transformers.AutoConfig.from_pretrained(saved["mistral3"]), 2)  # runs: no error
    # the text-only checkpoint has the same linear-attention layers (its TP run failed on the ranks)
    with pytest.raises(
        ValueError, match="model_type 'qwen3_5_text' cannot train with tensor_parallel_size > 1"
    ):
        validate_tensor_parallel(transformers.AutoConfig.for_model("qwen3_5_text"), 2)
    with pytest.raises(
        ValueError, match="model_type 'gemma4_text' cannot train with tensor_parallel_size > 1"
    ):
        validate_tensor_parallel(transformers.AutoConfig.for_model("gemma4_text"), 2)


@pytest.mark.slow  # a 2-rank `ndparallel train` (ranks forked from pytest)
def test_axolotl_mistral_medium_text_qlora_trains_on_two_ranks(tmp_path):
    """Axolotl's examples/mistral-medium-3_5/qlora-text.yml as written (paths, sizes and the 8-bit
    optimizer swapped) on a tiny Mistral3ForConditionalGeneration: QLoRA with the multimodal regex on
    FSDP 2 ranks, packed chat data; the adapter loads onto the multimodal class with PEFT and adapts
    the language model only."""
    from peft import PeftModel

    from axolotl_stand_ins import FIXTURES, tiny_multimodal
    from cli_helpers import train_on_forked_ranks
    from sft_fixtures import chat_records, llama3_tokenizer, write_jsonl

    tok = llama3_tokenizer()
    config = tiny_multimodal("mistral3")
    config.text_config.vocab_size = len(tok)
    torch.manual_seed(0)
    transformers.Mistral3ForConditionalGeneration(config).save_pretrained(tmp_path / "model")
    tok.save_pretrained(tmp_path / "model")
    write_jsonl(tmp_path / "chat.jsonl", chat_records(60))
    sets = [
        f"base_model={tmp_path / 'model'}",
        f"datasets.0.path={tmp_path / 'chat.jsonl'}",
        "sequence_len=128",
        "max_steps=2",
        "gradient_accumulation_steps=1",
        "micro_batch_size=1",
        "optimizer=adamw_torch",
        "output_dir=out",
        "nf4_block_size=2",
        "nf4_scaler_block_size=2",
    ]
    args = [
        "train",
        FIXTURES / "examples/mistral-medium-3_5/qlora-text.yml",
        "--nproc-per-node",
        "2",
        *[a for s in sets for a in ("--set", s)],
    ]
    proc = train_on_forked_ranks(args, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "Mistral3ForConditionalGeneration: a multimodal checkpoint" in proc.stdout
    base = transformers.Mistral3ForConditionalGeneration.from_pretrained(tmp_path / "model")
    lora = PeftModel.from_pretrained(base, tmp_path / "out" / "final")
    adapted = [n for n, m in lora.named_modules() if hasattr(m, "lora_A") and len(m.lora_A)]
    assert len(adapted) == 14 and all(".language_model.layers." in n for n in adapted), adapted


def test_transformers4_multimodal_names_refused_with_the_rename(saved):
    """Axolotl's Voxtral example writes transformers 4's names (language_model.model.layers...): they
    match nothing in transformers 5 (in Axolotl too); refused before launch with the rename."""
    from ndparallel.config import ConfigError, TrainConfig
    from ndparallel.preflight.model_check import check_adapter

    hf = transformers.AutoConfig.from_pretrained(saved["voxtral"])
    old = AXOLOTL_REGEX.replace("model.language_model.", "language_model.model.")
    cfg = TrainConfig(
        base_model=saved["voxtral"],
        datasets=[{"path": "builtin:stdlib"}],
        adapter="lora",
        lora_target_modules=old,
    )
    with pytest.raises(ConfigError, match=r"transformers 5 names .* write 'model\.language_model\.layers"):
        check_adapter(cfg, hf, 1)
    cfg = TrainConfig(
        base_model=saved["voxtral"],
        datasets=[{"path": "builtin:stdlib"}],
        adapter="lora",
        lora_target_modules=AXOLOTL_REGEX,
    )
    assert "on 14 layers" in check_adapter(cfg, hf, 1)


def test_chunked_loss_equals_the_logits_path(saved):
    """Mistral 3 and Voxtral compute ``lm_head(hidden)`` and nothing more: the chunked loss (Axolotl's
    CutCrossEntropy maps to it) is on for them and equals the logits path; Gemma 3 soft-caps: off."""
    import dataclasses

    from ndparallel.models.heads import plain_head_problem
    from ndparallel.models.multimodal import causal_lm_from_config
    from ndparallel.techniques.technique_options import LossOptions

    for mt in ("mistral3", "voxtral"):
        base = _setup(saved[mt])
        chunked = dataclasses.replace(
            base, parallel_kwargs={"loss_options": LossOptions(chunked=True, chunk_tokens=8)}
        )
        ref = run_on_ranks(_references, 1, {mt: base}, timeout_s=300)[0][mt]
        assert_matches(ref, run_on_ranks(_train_all, 1, {mt: chunked}, None, timeout_s=300)[0][mt])
    with torch.device("meta"):
        gemma = causal_lm_from_config(transformers.AutoConfig.from_pretrained(saved["gemma3"]))
    assert plain_head_problem(gemma) is not None
