"""Decisions made once on rank 0 and shared (``rank0_decides``), and checkpoint rotation that
renames old checkpoints away at once and deletes them in the background."""

import threading

import pytest

from ndparallel.checkpoint.directory import (
    list_checkpoints,
    rotate_checkpoints,
    write_marker,
)
from ndparallel.testing import run_on_ranks


def _decide(tmp: str, fail: bool):
    import torch.distributed as dist

    from ndparallel.runtime.distributed import rank0_decides

    def choose(path):
        with open(f"{path}/calls-{dist.get_rank()}", "w"):
            pass
        if fail:
            raise ValueError("no usable checkpoint")
        return {"step": 7}

    try:
        return rank0_decides(choose, tmp)
    except ValueError as e:
        return f"ValueError: {e}"


def test_rank0_decides_once_and_every_rank_agrees(tmp_path):
    assert run_on_ranks(_decide, 3, str(tmp_path), False) == [{"step": 7}] * 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["calls-0"]
    assert run_on_ranks(_decide, 3, str(tmp_path), True) == ["ValueError: no usable checkpoint"] * 3


def _fake_checkpoint(path, step):
    path.mkdir(parents=True)
    (path / ".metadata").write_bytes(b"x")
    (path / "state.json").write_text("{}")
    (path / "big.distcp").write_bytes(b"y" * 1000)
    write_marker(path, {"step": step, "world_size": 1, "layout": None})


def test_background_rotation_renames_then_deletes(tmp_path):
    for step in (1, 2, 3):
        _fake_checkpoint(tmp_path / f"checkpoint-{step}", step)
    (tmp_path / ".deleting-checkpoint-0-crashed").mkdir()  # leftover of an earlier crash
    doomed = rotate_checkpoints(tmp_path, 1, background=True)
    assert [p.name for p in doomed] == ["checkpoint-1", "checkpoint-2"]
    assert [s for s, _ in list_checkpoints(tmp_path)] == [3]  # gone from view at once
    for t in threading.enumerate():
        if t.name == "ndparallel-rotate":
            t.join(timeout=30)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-3"]


def test_rotation_limit_must_be_positive(tmp_path):
    with pytest.raises(ValueError, match="save_total_limit must be >= 1"):
        rotate_checkpoints(tmp_path, 0)
