"""Tokenizers: an existing Hugging Face tokenizer, or a byte-level BPE trained on the built-in corpus.

The trained tokenizer is cached under ``cache_dir/tokenizers/<key>/`` where the key holds the
vocabulary size and the corpus fingerprint, so a second call only loads it. Concurrent callers
(all ranks of a job sharing a filesystem) serialize on a file lock: the first one trains and
writes into a temporary directory which is then renamed into place with ``os.replace``; the
others wait for the lock and load the finished directory. A directory only appears complete.
A process that trained a tokenizer keeps its files: another cache directory asking for the same
key (another run's ``dataset_cache_dir``) gets a copy, not a second training (training is
deterministic: the same corpus and settings give the same tokenizer).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from filelock import FileLock
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from .corpus import BUILTIN_STDLIB, stdlib_corpus

EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
_FORMAT_VERSION = 1  # bump when the training recipe changes, to invalidate old caches
_TRAINED: dict[str, dict[str, bytes]] = {}
"""The files of each tokenizer this process trained, by cache key (a BPE of the whole stdlib: ~4 CPU s)."""


def default_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/ndparallel`` (``~/.cache/ndparallel`` by default)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "ndparallel"


def load_or_train_tokenizer(
    source: str | os.PathLike = BUILTIN_STDLIB,
    cache_dir: str | os.PathLike | None = None,
    vocab_size: int = 8192,
    *,
    max_files: int | None = None,
    max_bytes: int | None = None,
    min_frequency: int = 2,
    revision: str | None = None,
) -> PreTrainedTokenizerFast:
    """Return a fast tokenizer with an eos token (a Hub name's at ``revision``).

    ``source`` is ``"builtin:stdlib"`` (train or load a cached byte-level BPE on the stdlib
    corpus, capped by ``max_files``/``max_bytes``) or anything ``AutoTokenizer.from_pretrained``
    accepts (a local directory; a Hub name when online). Remote code is never executed.
    """
    if str(source) == BUILTIN_STDLIB:
        cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
        return _cached_stdlib_bpe(cache, vocab_size, max_files, max_bytes, min_frequency)
    return _load_pretrained(source, revision)


def _load_pretrained(source: str | os.PathLike, revision: str | None = None) -> PreTrainedTokenizerFast:
    try:
        tok = AutoTokenizer.from_pretrained(str(source), trust_remote_code=False, revision=revision)
    except Exception as e:  # missing dir, offline hub name, custom code...
        raise ValueError(
            f"tokenizer {str(source)!r} could not be loaded ({type(e).__name__}: {e}). Give a "
            f"directory holding tokenizer.json (e.g. the base model's), or {BUILTIN_STDLIB!r}."
        ) from e
    if not isinstance(tok, PreTrainedTokenizerFast):
        raise ValueError(f"tokenizer {str(source)!r} is not a fast tokenizer (no tokenizer.json)")
    if tok.eos_token_id is None:
        raise ValueError(
            f"tokenizer {str(source)!r} has no eos token, needed to separate packed documents; "
            "set 'eos_token' in its tokenizer_config.json"
        )
    return tok


def _cached_stdlib_bpe(
    cache: Path, vocab_size: int, max_files: int | None, max_bytes: int | None, min_frequency: int
) -> PreTrainedTokenizerFast:
    if vocab_size < 257 + 2:
        raise ValueError(f"vocab_size must be at least 259 (256 bytes + specials), got {vocab_size}")
    corpus = stdlib_corpus(max_files=max_files, max_bytes=max_bytes)
    key = f"stdlib-bpe-v{_FORMAT_VERSION}-{vocab_size}-f{min_frequency}-{corpus.fingerprint()[:16]}"
    root = cache / "tokenizers"
    final = root / key
    if not (final / "tokenizer.json").exists():
        root.mkdir(parents=True, exist_ok=True)
        with FileLock(str(final) + ".lock"):
            if not (final / "tokenizer.json").exists():  # another process may have built it
                tmp = root / f"{key}.tmp-{os.getpid()}"
                shutil.rmtree(tmp, ignore_errors=True)
                if key in _TRAINED:
                    tmp.mkdir()
                    for name, data in _TRAINED[key].items():
                        (tmp / name).write_bytes(data)
                else:
                    train_bpe(corpus.texts(), vocab_size, min_frequency).save_pretrained(tmp)
                    _TRAINED[key] = {f.name: f.read_bytes() for f in tmp.iterdir() if f.is_file()}
                os.replace(tmp, final)
    return PreTrainedTokenizerFast.from_pretrained(str(final))


def train_bpe(texts: list[str], vocab_size: int, min_frequency: int = 2) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE (GPT-2 style, no prefix space) with ``eos`` and ``pad`` specials."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=[EOS_TOKEN, PAD_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS_TOKEN, pad_token=PAD_TOKEN)
