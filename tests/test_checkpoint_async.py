"""Asynchronous checkpoints (``AsyncCheckpointer``, YAML ``checkpoint_async: true``): the same files
as a synchronous save of the same step while training goes on during the write; resuming from one
equals the uninterrupted run; a crash during the write leaves the previous complete checkpoint as
the resume point."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from ndparallel.checkpoint import MARKER, find_resume_checkpoint, list_checkpoints, validate_checkpoint
from ndparallel.checkpoint.io import SafeFileSystemReader, read_dcp_metadata
from ndparallel.runtime.multirank import RankFailure, run_on_ranks

sys.path.insert(0, str(Path(__file__).parent / "scripts"))
import ckpt_train  # noqa: E402

FSDP2 = {"dp_shard_size": 2}


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[int, float]:
    """Losses of an uninterrupted FSDP-2 run of 6 steps without checkpoints."""
    return run_on_ranks(ckpt_train.train, 2, FSDP2, str(tmp_path_factory.mktemp("ref")), steps=6)[0]["losses"]


def _tensors(ckpt: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a DCP checkpoint, whole, read on this one process."""
    meta = read_dcp_metadata(ckpt).state_dict_metadata
    out = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in meta.items() if hasattr(m, "size")}
    dcp.load(out, storage_reader=SafeFileSystemReader(ckpt), no_dist=True)
    return out


def test_async_checkpoint_is_the_sync_one_and_resumes_exactly(tmp_path, reference):
    ref = reference
    out = tmp_path / "run"
    # checkpoint-4's writer sleeps 1 s: steps 5 and 6 update the parameters while it is written
    run = run_on_ranks(
        ckpt_train.train,
        2,
        FSDP2,
        str(out),
        steps=6,
        save_every=2,
        async_saves=True,
        slow_write={4: 1.0},
        sync_copy_at=4,
    )[0]
    assert run["losses"] == ref  # saving in the background changes nothing in training
    assert [s for s, _ in list_checkpoints(out)] == [2, 4, 6]
    for s in (2, 4, 6):
        assert validate_checkpoint(out / f"checkpoint-{s}") == []  # the last one awaited at close()
    written, sync = _tensors(out / "checkpoint-4"), _tensors(out / "sync-copy")
    assert written.keys() == sync.keys() and len(written) > 10
    for key, value in sync.items():
        assert torch.equal(written[key], value), key  # the state of step 4, not of a later step
    assert not all(
        torch.equal(a, b) for a, b in zip(written.values(), _tensors(out / "checkpoint-6").values())
    )

    shutil.rmtree(out / "checkpoint-6")
    res = run_on_ranks(ckpt_train.train, 2, FSDP2, str(out), steps=6, resume=True)[0]
    assert res["losses"] == {5: ref[5], 6: ref[6]}  # bit-identical


def test_crash_during_async_write_resumes_from_previous_checkpoint(tmp_path, reference):
    ref = reference
    out = tmp_path / "run"
    with pytest.raises(RankFailure, match="died"):  # every rank dies while checkpoint-4 is written
        run_on_ranks(
            ckpt_train.train,
            2,
            FSDP2,
            str(out),
            steps=6,
            save_every=2,
            async_saves=True,
            slow_write={4: 60.0},
            die_after_save_at=4,
        )
    assert validate_checkpoint(out / "checkpoint-2") == []
    assert (out / "checkpoint-4").is_dir() and not (out / "checkpoint-4" / MARKER).exists()
    with pytest.warns(UserWarning, match="checkpoint-4"):
        assert find_resume_checkpoint(out, "auto") == out / "checkpoint-2"
    res = run_on_ranks(ckpt_train.train, 2, FSDP2, str(out), steps=6, resume=True)[0]
    assert res["losses"] == {s: ref[s] for s in (3, 4, 5, 6)}
