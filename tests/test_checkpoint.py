"""Checkpoints: resume equals an uninterrupted run (same and other layouts), completion markers,
rotation, incomplete/corrupted directories, no unpickling of untrusted data."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import sys
from pathlib import Path

import pytest
import torch

from ndparallel.checkpoint import (
    MARKER,
    find_resume_checkpoint,
    list_checkpoints,
    validate_checkpoint,
)
from ndparallel.checkpoint.io import join_tensors, read_dcp_metadata, split_tensors
from ndparallel.runtime.multirank import run_on_ranks

sys.path.insert(0, str(Path(__file__).parent / "scripts"))
import ckpt_train  # noqa: E402

FSDP2 = {"dp_shard_size": 2}


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(a), 1e-12)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """An uninterrupted FSDP-2 run of 4 steps, and one that saves every step (keeping 2) and stops
    after step 3."""
    root = tmp_path_factory.mktemp("ckpt")
    ref = run_on_ranks(ckpt_train.train, 2, FSDP2, str(root / "ref"))[0]
    part = run_on_ranks(
        ckpt_train.train, 2, FSDP2, str(root / "run"), save_every=1, stop_after=3, save_total_limit=2
    )[0]
    return {"root": root, "ref": ref, "part": part, "out": root / "run"}


def test_rotation_and_marker(runs):
    steps = [s for s, _ in list_checkpoints(runs["out"])]
    assert steps == [2, 3]  # save_total_limit=2 removed checkpoint-1
    info = json.loads((runs["out"] / "checkpoint-3" / MARKER).read_text())
    assert info["step"] == 3 and info["world_size"] == 2 and info["layout"]["dp_shard_size"] == 2
    assert {
        ".metadata",
        "state.json",
        "__0_0.distcp",
        "__1_0.distcp",
        "rng/rank-00000.json",
        "rng/rank-00001.json",
        "hf/config.json",
    } <= set(info["files"])
    assert validate_checkpoint(runs["out"] / "checkpoint-3") == []


def test_resume_same_layout_is_identical(runs, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(runs["out"], out)
    res = run_on_ranks(ckpt_train.train, 2, FSDP2, str(out), resume=True, reseed_before_load=True)[0]
    assert list(res["losses"]) == [4]
    assert res["losses"][4] == runs["ref"]["losses"][4]  # bit-identical
    assert res["rng_probe"] == runs["part"]["rng_probe"]  # RNG restored (after a reseed)
    assert res["lr"] == runs["ref"]["lr"]  # scheduler restored
    assert res["loader"] == runs["ref"]["loader"]  # data position restored


@pytest.mark.parametrize(
    "world,layout", [(4, {"dp_shard_size": 2, "tp_size": 2}), (1, {})], ids=["fsdp2xtp2", "one-rank"]
)
def test_resume_on_other_layout(runs, tmp_path, world, layout):
    if layout.get("tp_size", 1) > 1:
        pytest.importorskip("ndparallel.parallel.tp.tensor")
    out = tmp_path / "run"
    shutil.copytree(runs["out"], out)
    shutil.rmtree(out / "checkpoint-3")  # resume from step 2, so two steps follow
    res = run_on_ranks(ckpt_train.train, world, layout, str(out), resume=True)[0]
    assert list(res["losses"]) == [3, 4]
    for step in (3, 4):
        assert _rel(runs["ref"]["losses"][step], res["losses"][step]) <= 1e-5
    assert res["loader"] == runs["ref"]["loader"]


def test_resume_from_fsdp4_on_fsdp2(runs, tmp_path):
    """Saved by 4 ranks (FSDP 4), resumed by 2 (FSDP 2): a different world size."""
    out = tmp_path / "run"
    run_on_ranks(ckpt_train.train, 4, {"dp_shard_size": 4}, str(out), save_every=2, stop_after=2)
    assert json.loads((out / "checkpoint-2" / MARKER).read_text())["world_size"] == 4
    res = run_on_ranks(ckpt_train.train, 2, FSDP2, str(out), resume=True)[0]
    for step in (3, 4):
        assert _rel(runs["ref"]["losses"][step], res["losses"][step]) <= 1e-5


# ------------------------------------------------------------- incomplete / corrupted dirs
def _copy(runs, tmp_path) -> Path:
    out = tmp_path / "run"
    shutil.copytree(runs["out"], out)
    return out


def test_auto_skips_incomplete_checkpoint(runs, tmp_path):
    out = _copy(runs, tmp_path)
    (out / "checkpoint-3" / MARKER).unlink()  # as if the job died while saving step 3
    (out / "checkpoint-4").mkdir()  # a save that died before writing anything
    with pytest.warns(UserWarning) as record:
        assert find_resume_checkpoint(out, "auto") == out / "checkpoint-2"
    text = " ".join(str(w.message) for w in record)
    assert "checkpoint-3" in text and "checkpoint-4" in text and "COMPLETE" in text
    with pytest.raises(ValueError, match=r"checkpoint-3.*no COMPLETE marker"):
        find_resume_checkpoint(out, str(out / "checkpoint-3"))


@pytest.mark.parametrize("damage", ["truncated", "missing", "bitflip", "bad-marker"])
def test_corrupted_checkpoint_rejected(runs, tmp_path, damage):
    out = _copy(runs, tmp_path)
    ckpt = out / "checkpoint-3"
    if damage == "truncated":
        data = (ckpt / "__1_0.distcp").read_bytes()
        (ckpt / "__1_0.distcp").write_bytes(data[: len(data) // 2])
        expected = "__1_0.distcp has"
    elif damage == "missing":
        (ckpt / "rng" / "rank-00001.json").unlink()
        expected = "missing file rng/rank-00001.json"
    elif damage == "bitflip":
        data = bytearray((ckpt / "__0_0.distcp").read_bytes())
        data[len(data) // 2] ^= 0xFF
        (ckpt / "__0_0.distcp").write_bytes(bytes(data))
        expected = "sha256 mismatch"
    else:
        (ckpt / MARKER).write_text("{not json")
        expected = "unreadable COMPLETE"
    with pytest.raises(ValueError, match=expected):
        find_resume_checkpoint(out, ckpt)
    with pytest.warns(UserWarning, match="checkpoint-3"):
        assert find_resume_checkpoint(out, "auto") == out / "checkpoint-2"


def test_explicit_output_dir_and_none(runs):
    with pytest.raises(ValueError, match="resume_from_checkpoint: auto"):
        find_resume_checkpoint(None, runs["out"])  # the output dir, not a checkpoint
    assert find_resume_checkpoint(runs["out"], None) is None
    assert find_resume_checkpoint(runs["root"] / "nothing-here", "auto") is None


# --------------------------------------------------------------------------- safety
class _Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned > /dev/null",))


def test_malicious_metadata_is_refused(runs, tmp_path):
    out = _copy(runs, tmp_path)
    ckpt = out / "checkpoint-3"
    (ckpt / ".metadata").write_bytes(pickle.dumps(_Evil()))
    with pytest.raises(pickle.UnpicklingError, match="os.system|posix.system"):
        read_dcp_metadata(ckpt)
    assert any("metadata" in p or "sha256" in p or "bytes" in p for p in validate_checkpoint(ckpt))


def test_no_torch_load_without_weights_only(runs, tmp_path, monkeypatch):
    """Loading a checkpoint never calls pickle.load or torch.load(weights_only=False)."""
    real = torch.load

    def guarded(*args, **kwargs):
        assert kwargs.get("weights_only") is True, "torch.load without weights_only=True"
        return real(*args, **kwargs)

    def no_pickle(*args, **kwargs):
        raise AssertionError("pickle.load called")

    monkeypatch.setattr(torch, "load", guarded)
    monkeypatch.setattr(pickle, "load", no_pickle)
    out = _copy(runs, tmp_path)
    res = run_on_ranks(ckpt_train.train, 1, {}, str(out), resume=True)[0]
    assert _rel(runs["ref"]["losses"][4], res["losses"][4]) <= 1e-5


def test_split_join_roundtrip():
    state = {
        "a": torch.ones(2),
        "b": [1, (2.5, None), {"c": torch.zeros(1)}],
        3: "int key",
        "__x": True,
        "betas": (0.9, 0.999),
    }
    tensors: dict = {}
    skeleton = split_tensors(state, "p", tensors)
    json.dumps(skeleton)
    back = join_tensors(json.loads(json.dumps(skeleton)), tensors)
    assert back["b"][1] == (2.5, None) and back[3] == "int key" and back["betas"] == (0.9, 0.999)
    assert back["a"] is state["a"] and set(tensors) == {"p/a", "p/b/2/c"}
    with pytest.raises(TypeError, match="cannot store a object"):
        split_tensors({"x": object()}, "p", {})


def _save_into(path: str) -> None:
    from ndparallel import Accelerator
    from ndparallel.checkpoint import save_checkpoint
    from ndparallel.tools.equivalence import build_model, setup_optimizer

    setup = ckpt_train.make_setup()
    acc = Accelerator()
    model = build_model(setup)
    optimizer = setup_optimizer(setup, model.parameters())
    model, optimizer = acc.prepare(model, optimizer)
    save_checkpoint(path, model, optimizer, step=0)


def test_save_refuses_a_directory_with_other_files(tmp_path):
    from ndparallel.runtime.multirank import RankFailure

    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(RankFailure, match="holds other files"):
        run_on_ranks(_save_into, 1, str(tmp_path))
    assert (tmp_path / "notes.txt").read_text() == "mine"
    run_on_ranks(_save_into, 1, str(tmp_path / "new"))
    run_on_ranks(_save_into, 1, str(tmp_path / "new"))  # overwriting a checkpoint is fine
    assert validate_checkpoint(tmp_path / "new") == []
