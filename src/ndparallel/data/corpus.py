"""The built-in corpus: the Python standard library's own ``.py`` sources.

Present on every machine that runs ndparallel, so the quickstart, the tests and the tokenizer
need no download. Files are listed in sorted relative-path order (deterministic for one Python
build); tests, ``site-packages`` and build-config directories are skipped.
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import datasets

BUILTIN_STDLIB = "builtin:stdlib"
"""Dataset/tokenizer spec naming this corpus."""

_SKIP_DIRS = frozenset({"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"})


@dataclass(frozen=True)
class StdlibCorpus:
    """A capped, ordered selection of stdlib source files."""

    root: Path
    files: tuple[Path, ...]

    def texts(self) -> list[str]:
        """File contents, decoded as UTF-8 (undecodable bytes replaced)."""
        return [p.read_bytes().decode("utf-8", errors="replace") for p in self.files]

    def fingerprint(self) -> str:
        """SHA-256 over relative paths and contents: changes iff the corpus changes."""
        h = hashlib.sha256()
        for p in self.files:
            h.update(p.relative_to(self.root).as_posix().encode())
            h.update(b"\0")
            h.update(hashlib.sha256(p.read_bytes()).digest())
        return h.hexdigest()

    def to_dataset(self) -> datasets.Dataset:
        """A ``datasets.Dataset`` with one row ``{"text": source}`` per file."""
        return datasets.Dataset.from_dict({"text": self.texts()})


def stdlib_root() -> Path:
    """The directory of the running interpreter's standard library."""
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_corpus(max_files: int | None = None, max_bytes: int | None = None) -> StdlibCorpus:
    """Select stdlib ``.py`` files in sorted order.

    ``max_files`` keeps the first N files; ``max_bytes`` stops after the file that brings the
    total size to at least ``max_bytes`` (so at least one file is always kept).
    """
    if max_files is not None and max_files < 1:
        raise ValueError(f"max_files must be >= 1 or None, got {max_files}")
    if max_bytes is not None and max_bytes < 1:
        raise ValueError(f"max_bytes must be >= 1 or None, got {max_bytes}")
    root = stdlib_root()
    found: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS and not d.startswith("config-")]
        found.extend(Path(dirpath) / f for f in filenames if f.endswith(".py"))
    found.sort(key=lambda p: p.relative_to(root).as_posix())
    if not found:
        raise ValueError(
            f"no .py files under the stdlib directory {root}; this Python ships without sources. "
            "Use a dataset path / tokenizer directory instead of 'builtin:stdlib'."
        )
    selected: list[Path] = []
    total = 0
    for p in found:
        if max_files is not None and len(selected) >= max_files:
            break
        if max_bytes is not None and total >= max_bytes:
            break
        selected.append(p)
        total += p.stat().st_size
    return StdlibCorpus(root=root, files=tuple(selected))


def stdlib_dataset(max_files: int | None = None, max_bytes: int | None = None) -> datasets.Dataset:
    """Shortcut: ``stdlib_corpus(max_files, max_bytes).to_dataset()``."""
    return stdlib_corpus(max_files, max_bytes).to_dataset()
