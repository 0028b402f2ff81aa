"""Tokenizer: trained BPE on the stdlib corpus (cached, concurrent-safe) or an HF tokenizer directory."""

import multiprocessing as mp
import time

import pytest
from transformers import PreTrainedTokenizerFast

from ndparallel.data import load_or_train_tokenizer, stdlib_corpus, train_bpe
from ndparallel.data import tokenizer as tokmod

CAP = dict(vocab_size=512, max_bytes=300_000)


def test_train_cache_roundtrip(tmp_path, monkeypatch):
    monkeypatch.setattr(tokmod, "_TRAINED", {})  # trained here, not copied from an earlier test's
    t0 = time.perf_counter()
    tok = load_or_train_tokenizer("builtin:stdlib", tmp_path, vocab_size=1024, max_bytes=1_000_000)
    first = time.perf_counter() - t0
    assert isinstance(tok, PreTrainedTokenizerFast) and len(tok) == 1024
    assert tok.eos_token == "<|endoftext|>" and tok.eos_token_id is not None
    assert tok.pad_token_id is not None and tok.pad_token_id != tok.eos_token_id
    for text in ["def f(x):\n    return x ** 2  # comment\n", "héllo ∑ 日本 \t\n  ", ""]:
        assert tok.decode(tok(text)["input_ids"]) == text
    assert tok("x = 1")["input_ids"][-1] != tok.eos_token_id  # no specials added implicitly

    monkeypatch.setattr(
        tokmod, "train_bpe", lambda *a, **k: pytest.fail("retrained instead of using the cache")
    )
    t0 = time.perf_counter()
    again = load_or_train_tokenizer("builtin:stdlib", tmp_path, vocab_size=1024, max_bytes=1_000_000)
    assert time.perf_counter() - t0 < first
    assert again.get_vocab() == tok.get_vocab()
    entries = list((tmp_path / "tokenizers").iterdir())
    assert not [e for e in entries if ".tmp-" in e.name]
    assert len([e for e in entries if e.is_dir()]) == 1


def test_cache_key_depends_on_vocab_and_corpus(tmp_path):
    load_or_train_tokenizer(cache_dir=tmp_path, **CAP)
    load_or_train_tokenizer(cache_dir=tmp_path, vocab_size=600, max_bytes=300_000)
    load_or_train_tokenizer(cache_dir=tmp_path, vocab_size=512, max_bytes=300_000, max_files=10)
    assert len([e for e in (tmp_path / "tokenizers").iterdir() if e.is_dir()]) == 3


def _worker(cache_dir, queue):
    tok = load_or_train_tokenizer(cache_dir=cache_dir, **CAP)
    queue.put(sorted(tok.get_vocab().items()))


def test_concurrent_builders_agree(tmp_path, monkeypatch):
    monkeypatch.setattr(tokmod, "_TRAINED", {})  # the forked builders train, none copies
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(str(tmp_path), queue)) for _ in range(3)]
    for p in procs:
        p.start()
    vocabs = [queue.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert vocabs[0] == vocabs[1] == vocabs[2]
    assert len([e for e in (tmp_path / "tokenizers").iterdir() if e.is_dir()]) == 1


def test_training_is_deterministic():
    texts = stdlib_corpus(max_bytes=100_000).texts()
    assert train_bpe(texts, 400).get_vocab() == train_bpe(texts, 400).get_vocab()


def test_hf_directory(tmp_path):
    tok = load_or_train_tokenizer(cache_dir=tmp_path / "c", **CAP)
    tok.save_pretrained(tmp_path / "tok")
    loaded = load_or_train_tokenizer(tmp_path / "tok")
    assert loaded.get_vocab() == tok.get_vocab() and loaded.eos_token_id == tok.eos_token_id


def test_errors(tmp_path):
    with pytest.raises(ValueError, match="could not be loaded"):
        load_or_train_tokenizer(tmp_path / "nope")
    tok = train_bpe(stdlib_corpus(max_files=3).texts(), 300)
    tok.eos_token = None
    tok.save_pretrained(tmp_path / "noeos")
    with pytest.raises(ValueError, match="no eos token"):
        load_or_train_tokenizer(tmp_path / "noeos")
    with pytest.raises(ValueError, match="vocab_size"):
        load_or_train_tokenizer(cache_dir=tmp_path, vocab_size=100)


def test_a_tokenizer_trained_once_is_copied_into_another_cache(tmp_path, monkeypatch):
    """Another run's cache directory gets the files this process trained, not a second training."""
    monkeypatch.setattr(tokmod, "_TRAINED", {})
    tok = load_or_train_tokenizer(cache_dir=tmp_path / "a", **CAP)
    monkeypatch.setattr(tokmod, "train_bpe", lambda *a, **k: pytest.fail("trained the same tokenizer twice"))
    again = load_or_train_tokenizer(cache_dir=tmp_path / "b", **CAP)
    assert again.get_vocab() == tok.get_vocab()
    assert [e.name for e in (tmp_path / "b" / "tokenizers").iterdir() if e.is_dir()] == [
        e.name for e in (tmp_path / "a" / "tokenizers").iterdir() if e.is_dir()
    ]
