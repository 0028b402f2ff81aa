"""A checkpoint directory on disk: its completion marker, validation, the ``checkpoint-N`` step
directories of a run, rotation, and the choice of the checkpoint to resume from.

``COMPLETE`` is written last (tmp file + ``os.replace``) and lists every file with its size (and a
sha256 of the small ones): a directory without a valid marker is never taken for a checkpoint.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import threading
import time
import warnings
from pathlib import Path
from typing import Any

from ndparallel.checkpoint.io import read_dcp_metadata, read_json, write_json_atomic
from ndparallel.checkpoint.ownership import claim, may_replace

FORMAT = "ndparallel-checkpoint/1"
MARKER = "COMPLETE"
STATE_FILE = "state.json"
HF_CONFIG_DIR = "hf"
CHECKPOINT_PREFIX = "checkpoint-"
_HASH_LIMIT = 16 << 20  # sha256 for files up to this size


def checkpoint_dir(output_dir: str | os.PathLike, step: int) -> Path:
    return Path(output_dir) / f"{CHECKPOINT_PREFIX}{int(step)}"


def list_checkpoints(
    output_dir: str | os.PathLike, prefix: str = CHECKPOINT_PREFIX
) -> list[tuple[int, Path]]:
    """``(step, path)`` of every ``{prefix}N`` directory (``checkpoint-N``; Accelerate's automatic
    naming: ``checkpoint_N``), complete or not, oldest first."""
    root = Path(output_dir)
    if not root.is_dir():
        return []
    pattern = re.compile(rf"^{re.escape(prefix)}(\d+)$")
    found = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := pattern.match(p.name))]
    return sorted(found)


def rotate_checkpoints(
    output_dir: str | os.PathLike,
    save_total_limit: int,
    background: bool = False,
    prefix: str = CHECKPOINT_PREFIX,
) -> list[Path]:
    """Keep the newest ``save_total_limit`` complete checkpoints; delete older complete ones and
    incomplete leftovers older than the newest complete one. Returns what was deleted.

    ``background``: each doomed directory is first renamed out of the way (``.deleting-…``; its
    marker removed first, so it is never taken for a checkpoint), then removed by a background
    thread, so the caller is not held for the minutes an ``rmtree`` of terabytes takes while its
    peers wait in a timed collective. Leftovers of a crash are swept by the next rotation."""
    if save_total_limit < 1:
        raise ValueError(f"save_total_limit must be >= 1, got {save_total_limit}")
    entries = list_checkpoints(output_dir, prefix)
    complete = [(s, p) for s, p in entries if not validate_checkpoint(p, deep=False)]
    if not complete:
        return []
    keep = {p for _, p in complete[-save_total_limit:]}
    newest = complete[-1][0]
    doomed = [
        p
        for s, p in entries
        if p not in keep and (p in dict(complete).values() or s < newest) and may_replace(p)
    ]  # never a checkpoint this run did not write (ownership.py)
    if not background:
        for p in doomed:
            _delete_checkpoint(p)
        return doomed
    trash = [_move_to_trash(p) for p in doomed]
    trash += [p for p in Path(output_dir).glob(f"{_TRASH_PREFIX}*") if p not in trash]
    # not a daemon: the interpreter waits for it at exit, so a finished job leaves no half-deleted dir
    threading.Thread(target=_delete_all, args=(trash,), name="ndparallel-rotate").start()
    return doomed


# ------------------------------------------------------------------- validation and resume
def validate_checkpoint(path: str | os.PathLike, deep: bool = True) -> list[str]:
    """What is wrong with checkpoint ``path`` (empty list: complete and intact). ``deep`` also
    re-hashes the small files and parses the DCP metadata."""
    path = Path(path)
    if not path.is_dir():
        return [f"{path} is not a directory"]
    marker = path / MARKER
    if not marker.is_file():
        return [f"no {MARKER} marker (the save did not finish)"]
    try:
        info = read_json(marker)
        files = info["files"]
        if info.get("format") != FORMAT:
            return [f"{MARKER} has format {info.get('format')!r}, expected {FORMAT!r}"]
    except Exception as exc:  # noqa: BLE001 - any unreadable marker is corruption
        return [f"unreadable {MARKER} marker ({type(exc).__name__}: {exc})"]
    problems = []
    for name in (".metadata", STATE_FILE):
        if name not in files:
            problems.append(f"{MARKER} does not list {name}")
    for name, meta in files.items():
        f = path / name
        if not f.is_file():
            problems.append(f"missing file {name}")
        elif f.stat().st_size != meta["size"]:
            problems.append(f"file {name} has {f.stat().st_size} bytes, expected {meta['size']}")
        elif deep and "sha256" in meta and _sha256(f) != meta["sha256"]:
            problems.append(f"file {name} is corrupted (sha256 mismatch)")
    if deep and not problems:
        try:
            read_dcp_metadata(path)
            read_json(path / STATE_FILE)
        except Exception as exc:  # noqa: BLE001
            problems.append(f"unreadable metadata ({type(exc).__name__}: {exc})")
    return problems


def find_resume_checkpoint(output_dir: str | os.PathLike | None, resume_from_checkpoint: Any) -> Path | None:
    """The checkpoint to resume from: ``None``/``False``/``""`` → none; ``"auto"``/``True`` → the
    newest complete ``checkpoint-N`` in ``output_dir`` (incomplete or corrupted ones are skipped
    with a warning naming them; none → ``None``); a path → that checkpoint, or ``ValueError``
    naming the path and what is wrong with it."""
    if resume_from_checkpoint in (None, False, ""):
        return None
    if resume_from_checkpoint is True or resume_from_checkpoint == "auto":
        if output_dir is None:
            raise ValueError("resume_from_checkpoint='auto' needs an output_dir to search")
        for _step, path in reversed(list_checkpoints(output_dir)):
            problems = validate_checkpoint(path)
            if not problems:
                return path
            warnings.warn(f"skipping checkpoint {path}: " + "; ".join(problems), stacklevel=2)
        return None
    path = Path(resume_from_checkpoint)
    problems = validate_checkpoint(path)
    if problems:
        hint = ""
        if list_checkpoints(path):
            hint = " (it holds checkpoint-N directories: pass one of them, or resume_from_checkpoint: auto)"
        raise ValueError(
            f"resume_from_checkpoint={str(path)!r} is not a usable checkpoint: " + "; ".join(problems) + hint
        )
    return path


# ----------------------------------------------------------------------------- writing
def _is_checkpoint_file(name: str) -> bool:
    return (
        name in (".metadata", STATE_FILE, MARKER, "rng", HF_CONFIG_DIR)
        or name.endswith(".distcp")
        or name.startswith((f".{MARKER}.tmp", f".{STATE_FILE}.tmp"))
    )


def check_target_dir(directory: Path) -> None:
    """Refuse to overwrite a directory that holds anything but an (old or partial) checkpoint."""
    if directory.exists():
        if not directory.is_dir():
            raise ValueError(f"cannot save a checkpoint to {directory}: it is a file")
        if not may_replace(directory):
            raise ValueError(
                f"cannot save a checkpoint to {directory}: it exists and this run did not "
                "write it; move it away or use another output_dir"
            )
        foreign = sorted(p.name for p in directory.iterdir() if not _is_checkpoint_file(p.name))
        if foreign:
            raise ValueError(
                f"cannot save a checkpoint to {directory}: it holds other files ({foreign[:3]}); "
                "use an empty or new directory"
            )


def prepare_dir(directory: Path) -> None:
    """Empty a leftover directory (an old or half-written save) and create it; marker first."""
    claim(directory.parent, directory.name)  # the run's own from now on (ownership.py)
    if directory.exists():
        (directory / MARKER).unlink(missing_ok=True)
        shutil.rmtree(directory)
    directory.mkdir(parents=True)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def write_marker(directory: Path, state: dict) -> None:
    files = {}
    for f in sorted(directory.rglob("*")):
        if f.is_file() and f.name != MARKER and not f.name.startswith(f".{MARKER}"):
            size = f.stat().st_size
            entry = {"size": size}
            if size <= _HASH_LIMIT:
                entry["sha256"] = _sha256(f)
            files[f.relative_to(directory).as_posix()] = entry
    write_json_atomic(
        directory / MARKER,
        {
            "format": FORMAT,
            "step": state["step"],
            "world_size": state["world_size"],
            "layout": state["layout"],
            "time": time.time(),
            "files": files,
        },
    )


def _delete_checkpoint(path: Path) -> None:
    (path / MARKER).unlink(missing_ok=True)  # first: a half-deleted dir is never "complete"
    shutil.rmtree(path, ignore_errors=True)


_TRASH_PREFIX = ".deleting-"


def _move_to_trash(path: Path) -> Path:
    (path / MARKER).unlink(missing_ok=True)
    target = path.with_name(f"{_TRASH_PREFIX}{path.name}-{os.getpid()}-{time.time_ns()}")
    os.replace(path, target)  # same directory: atomic and instant, whatever the size
    return target


def _delete_all(paths: list[Path]) -> None:
    for p in paths:
        shutil.rmtree(p, ignore_errors=True)
