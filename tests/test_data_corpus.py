"""The built-in stdlib corpus: present, deterministic, capped, exposed as a datasets.Dataset."""

import pytest

from ndparallel.data import BUILTIN_STDLIB, stdlib_corpus, stdlib_dataset


def test_corpus_nonempty_sorted_and_skips_tests():
    c = stdlib_corpus()
    rel = [p.relative_to(c.root).as_posix() for p in c.files]
    assert len(rel) > 100 and "os.py" in rel
    assert rel == sorted(rel)
    assert all(p.endswith(".py") for p in rel)
    parts = {part for r in rel for part in r.split("/")[:-1]}
    assert not parts & {"test", "tests", "site-packages", "idle_test", "__pycache__"}


def test_corpus_deterministic_and_fingerprint():
    a, b = stdlib_corpus(max_files=20), stdlib_corpus(max_files=20)
    assert a.files == b.files and a.texts() == b.texts()
    assert a.fingerprint() == b.fingerprint()
    assert a.fingerprint() != stdlib_corpus(max_files=21).fingerprint()


def test_caps():
    assert len(stdlib_corpus(max_files=5).files) == 5
    c = stdlib_corpus(max_bytes=50_000)
    sizes = [p.stat().st_size for p in c.files]
    assert sum(sizes) >= 50_000 and sum(sizes[:-1]) < 50_000  # stops after the file crossing the cap
    assert len(stdlib_corpus(max_bytes=1).files) == 1
    with pytest.raises(ValueError, match="max_files"):
        stdlib_corpus(max_files=0)


def test_dataset():
    ds = stdlib_dataset(max_files=7)
    assert ds.column_names == ["text"] and len(ds) == 7
    assert ds[0]["text"] == stdlib_corpus(max_files=7).texts()[0]
    assert BUILTIN_STDLIB == "builtin:stdlib"
