"""Tokens added to a pretrained model's tokenizer (``tokens``, ``special_tokens`` not in its
vocabulary): the model is loaded sharded with grown embedding / LM-head rows equal to what
transformers' ``resize_token_embeddings`` + mean rows give on one process (tied and untied, on
FSDP 2 × TP 2); the grown size rounds up for TP and to 32; a chat fine-tune with ChatML tokens new to a
Llama-3-style
base trains end to end on FSDP 2 and saves a model and tokenizer that agree; LoRA is refused."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from ndparallel.testing import run_on_ranks

sys.path.insert(0, str(Path(__file__).parent))
from sft_fixtures import chat_records, tiny_llama_dir, write_jsonl  # noqa: E402

ADDED = 4  # rows added: vocab 256 -> 260


def test_new_rows_are_the_mean_row():
    from ndparallel.models.vocab import grow_rows

    w = torch.randn(5, 4, dtype=torch.bfloat16)
    g = grow_rows(w, 8)
    assert g.shape == (8, 4) and torch.equal(g[:5], w)
    assert torch.equal(g[5], w.float().mean(0).to(torch.bfloat16)) and torch.equal(g[5], g[7])
    with pytest.raises(ValueError, match="cannot shrink"):
        grow_rows(w, 4)


def _save_base(path: str, tied: bool) -> None:
    from transformers import AutoModelForCausalLM

    from ndparallel.models.presets import preset_config

    cfg = preset_config("tiny-llama")
    cfg.tie_word_embeddings = tied
    torch.manual_seed(1)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(path)


def _reference(path: str, rows: int) -> dict:
    """transformers' own resize on one process, the new rows then set to the mean row."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path)
    old = model.get_input_embeddings().weight.shape[0]
    model.resize_token_embeddings(rows, mean_resizing=False)
    with torch.no_grad():
        for emb in {id(m): m for m in (model.get_input_embeddings(), model.get_output_embeddings())}.values():
            emb.weight[old:] = emb.weight[:old].float().mean(0)
    ids = torch.arange(rows - 8, rows).repeat(2, 2)  # the new tokens among the last ones
    return {
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
        "loss": float(model(input_ids=ids, labels=ids).loss),
    }


def _ours(path: str, layout: dict, rows: int) -> dict:
    from ndparallel import Accelerator, ParallelismConfig

    acc = Accelerator(ParallelismConfig(**layout))
    model = acc.load_model(path, vocab_size=rows)
    params = {}
    for n, p in model.named_parameters():
        params[n] = (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
    ids = torch.arange(rows - 8, rows).repeat(2, 2)
    return {
        "params": params,
        "loss": float(model(input_ids=ids, labels=ids).loss),
        "vocab": model.config.vocab_size,
    }


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_grown_model_on_fsdp2_tp2_equals_transformers_resize(tmp_path, tied):
    path = str(tmp_path / "base")
    run_on_ranks(_save_base, 1, path, tied)
    rows = 256 + ADDED
    ref = run_on_ranks(_reference, 1, path, rows)[0]
    got = run_on_ranks(_ours, 4, path, {"dp_shard_size": 2, "tp_size": 2}, rows, timeout_s=400)[0]
    assert got["vocab"] == rows
    assert set(got["params"]) == set(ref["params"])
    for n, t in ref["params"].items():
        assert torch.equal(got["params"][n], t), n
    assert abs(got["loss"] - ref["loss"]) <= 1e-5 * ref["loss"], (got["loss"], ref["loss"])


@pytest.mark.parametrize(
    "tokens, x32, tp, want",
    [
        (256, False, 1, None),
        (259, False, 1, 259),
        (259, False, 2, 260),
        (259, True, 1, 288),
        (259, True, 3, 288),
    ],
)
def test_grown_vocab_size_rounds_for_tp_and_32x(tokens, x32, tp, want):
    from ndparallel.axolotl import load_config
    from ndparallel.training.components import grown_vocab_size

    cfg = load_config(
        None, [f"resize_token_embeddings_to_32x={str(x32).lower()}", f"tensor_parallel_size={tp}"]
    )
    assert grown_vocab_size(cfg, range(tokens), 256) == want


def test_a_shrinking_or_lora_vocab_is_refused():
    from transformers import LlamaConfig

    from ndparallel.models.vocab import grow_config_vocab

    cfg = LlamaConfig(vocab_size=100)
    with pytest.raises(ValueError, match="only grows"):
        grow_config_vocab(cfg, 90)
    with pytest.raises(ValueError, match="LoRA run"):
        grow_config_vocab(cfg, 101, lora=True)
    assert grow_config_vocab(cfg, 100) is False and cfg.vocab_size == 100
    assert grow_config_vocab(cfg, 128) is True and cfg.vocab_size == 128


# ------------------------------------------------------------------ `ndparallel train` end to end
@pytest.fixture(scope="module")
def chat_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("added_tokens")
    base = tiny_llama_dir(root / "base")
    data = write_jsonl(root / "chat.jsonl", chat_records(64))
    cfg = {
        "base_model": str(base),
        "output_dir": str(root / "out"),
        "dataset_cache_dir": str(root / "cache"),
        "datasets": [{"path": str(data), "type": "chat_template"}],
        "chat_template": "chatml",
        "tokens": ["<|im_start|>", "<|im_end|>"],
        "resize_token_embeddings_to_32x": True,
        "sequence_len": 128,
        "micro_batch_size": 2,
        "max_steps": 3,
        "learning_rate": 1e-2,
        "dp_shard_size": 2,
        "device": "cpu",
        "logging_steps": 1,
    }
    (root / "cfg.yaml").write_text(json.dumps(cfg))
    return root


def _train(path: str):
    from ndparallel.axolotl import load_config
    from ndparallel.training.trainer import run_training

    run_training(load_config(path))
    return True


def test_chat_fine_tune_adds_chatml_tokens(chat_run):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base_tok = AutoTokenizer.from_pretrained(chat_run / "base")
    assert "<|im_start|>" not in base_tok.get_vocab()
    run_on_ranks(_train, 2, str(chat_run / "cfg.yaml"), timeout_s=400)
    final = chat_run / "out" / "final"
    tok = AutoTokenizer.from_pretrained(final)
    model = AutoModelForCausalLM.from_pretrained(final)
    new_ids = tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    assert new_ids == [len(base_tok), len(base_tok) + 1]  # appended after the base vocabulary
    assert (
        model.config.vocab_size == -(-len(tok) // 32) * 32 > len(base_tok)
    )  # resize_token_embeddings_to_32x
    assert tok("<|im_start|>user").input_ids[1] == new_ids[0]  # one token, not split
    emb = model.get_input_embeddings().weight.detach()
    base = AutoModelForCausalLM.from_pretrained(chat_run / "base").get_input_embeddings().weight.detach()
    mean = base.float().mean(0)
    assert (emb[new_ids[0]] - mean).abs().max() > 1e-4  # a token of every sample: trained away from the mean
    unused = emb[len(tok) :]  # padding rows no token maps to: never in the data, still the mean
    assert unused.shape[0] > 0 and torch.allclose(unused, mean.expand_as(unused), atol=1e-6)


def test_lora_with_new_tokens_is_refused_before_launch(chat_run, tmp_path, capsys):
    from ndparallel.cli import main

    cfg = json.loads((chat_run / "cfg.yaml").read_text())
    cfg.update(adapter="lora", output_dir=str(tmp_path / "out"))
    (tmp_path / "cfg.yaml").write_text(json.dumps(cfg))
    code = main(["train", str(tmp_path / "cfg.yaml"), "--nproc-per-node", "2"])
    err = capsys.readouterr().err
    assert code == 2 and "with adapter: lora their embedding rows would stay frozen" in err, err
    assert len(err.strip().splitlines()) == 1, err


def _train_overrides(overrides):
    from ndparallel.axolotl import load_config
    from ndparallel.training.trainer import run_training

    run_training(load_config(None, overrides))
    return True


def test_a_preset_with_an_odd_vocabulary_under_tp_is_rounded(tmp_path):
    """A built-in model gets a row per token of the run's tokenizer: 512 + 1 added = 513 tokens,
    rounded to 514 rows for TP 2 (else the ranks would fail TP's divisibility check)."""
    from transformers import AutoConfig, AutoTokenizer

    run_on_ranks(
        _train_overrides,
        2,
        [
            "base_model=tiny-llama",
            "tokenizer_vocab_size=512",
            "tokens=['<extra>']",
            "tensor_parallel_size=2",
            "device=cpu",
            "sequence_len=32",
            "max_steps=1",
            "datasets=[{path: 'builtin:stdlib', max_bytes: 100000}]",
            f"output_dir={tmp_path / 'out'}",
            f"dataset_cache_dir={tmp_path / 'cache'}",
        ],
        timeout_s=300,
    )
    tok = AutoTokenizer.from_pretrained(tmp_path / "out" / "final")
    assert len(tok) % 2 == 1 and "<extra>" in tok.get_vocab()
    assert AutoConfig.from_pretrained(tmp_path / "out" / "final").vocab_size == len(tok) + 1
