"""Online trackers without credentials, or with a server out of reach, are refused before launch
with the fix (issue #37), never a rank's ``wandb.init`` traceback."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from cli_helpers import forbid_launch, run_cli


@pytest.fixture(autouse=True)
def _no_credentials(monkeypatch, tmp_path):
    forbid_launch(monkeypatch)
    for var in (
        "WANDB_API_KEY",
        "WANDB_MODE",
        "WANDB_BASE_URL",
        "MLFLOW_TRACKING_URI",
        "SWANLAB_API_KEY",
        "SWANLAB_MODE",
    ):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))


def cfg(tmp_path: Path, extra: str) -> Path:
    p = tmp_path / "cfg.yaml"
    p.write_text(
        f"base_model: tiny-llama\ntokenizer_vocab_size: 512\nsequence_len: 32\nmax_steps: 1\n"
        f"output_dir: {tmp_path / 'out'}\ndataset_cache_dir: {tmp_path / 'cache'}\n{extra}"
    )
    return p


def problem(tmp_path, extra: str):
    from ndparallel.axolotl import load_config
    from ndparallel.tracking.credentials import tracker_problem

    return tracker_problem(load_config(str(cfg(tmp_path, extra)), []))


def test_wandb_project_without_a_key_is_refused_before_launch(tmp_path, capsys):
    code, _, err = run_cli(capsys, "train", cfg(tmp_path, "wandb_project: qwen2-pretrain\n"))
    assert code == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert "no W&B API key" in err and "wandb login" in err and "wandb_mode: offline" in err, err
    assert not (tmp_path / "out").exists()


def test_wandb_offline_or_disabled_needs_no_key(tmp_path, monkeypatch):
    assert problem(tmp_path, "wandb_project: p\nwandb_mode: offline\n") is None
    assert problem(tmp_path, "wandb_project: p\nwandb_mode: disabled\n") is None
    monkeypatch.setenv("WANDB_MODE", "offline")
    assert problem(tmp_path, "wandb_project: p\n") is None


@pytest.fixture
def server():
    """A listening local port: a reachable tracker host."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield f"http://127.0.0.1:{s.getsockname()[1]}"


def test_wandb_key_from_netrc_or_env_with_a_reachable_host_passes(tmp_path, monkeypatch, server):
    monkeypatch.setenv("WANDB_BASE_URL", server)
    netrc = tmp_path / "netrc"
    netrc.write_text("machine 127.0.0.1 login user password abc\n")
    monkeypatch.setenv("NETRC", str(netrc))
    assert problem(tmp_path, "wandb_project: p\n") is None
    monkeypatch.setenv("NETRC", str(tmp_path / "none"))
    monkeypatch.setenv("WANDB_API_KEY", "abc")
    assert problem(tmp_path, "wandb_project: p\n") is None


def test_wandb_host_out_of_reach_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_API_KEY", "abc")
    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")
    assert "cannot be reached" in problem(tmp_path, "wandb_project: p\n")


def test_mlflow_server_out_of_reach_is_refused_and_a_local_store_noted(tmp_path):
    assert "remove mlflow_tracking_uri" in problem(tmp_path, "mlflow_tracking_uri: http://127.0.0.1:9\n")
    assert problem(tmp_path, f"mlflow_tracking_uri: file://{tmp_path}/mlruns\n") is None
    from ndparallel.axolotl import load_config
    from ndparallel.tracking.credentials import tracker_notes

    notes = tracker_notes(load_config(str(cfg(tmp_path, "mlflow_experiment_name: e\n")), []))
    assert len(notes) == 1 and "./mlruns" in notes[0]


def test_swanlab_cloud_without_a_key_is_refused(tmp_path):
    assert "swanlab login" in problem(tmp_path, "swanlab_project: p\n")
    assert problem(tmp_path, "swanlab_project: p\nswanlab_mode: offline\n") is None


def test_dry_run_says_what_train_would_refuse(tmp_path, capsys):
    code, out, err = run_cli(capsys, "train", cfg(tmp_path, "wandb_project: p\n"), "--dry-run")
    assert code == 0, err
    assert "train would refuse here: wandb_project is set" in out, out
