"""`ndparallel train` config errors, dry runs of every example, and `plot`."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cli_helpers import run_cli
from ndparallel.axolotl import ConfigError, load_config

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted((ROOT / "examples").rglob("*.yaml"))


def _cli(*args, timeout=120):
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"}
    return subprocess.run(
        [sys.executable, "-m", "ndparallel", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env=env,
    )


def _yaml(tmp_path, text):
    p = tmp_path / "cfg.yaml"
    p.write_text(text)
    return str(p)


@pytest.mark.parametrize(
    "text, fragment",
    [
        ("dp_shard_sise: 2\n", "unknown key 'dp_shard_sise'; did you mean 'dp_shard_size'?"),
        ("tensor_parallel_size: two\n", "'tensor_parallel_size': Input should be a valid integer"),
        ("fsdp_config: {reshard_after_forwad: true}\n", "did you mean 'reshard_after_forward'"),
        ("tensor_parallel_size: 3\n", "num_attention_heads"),  # 4 heads, tp 3
        ("context_parallel_size: 2\nsequence_len: 30\n", "sequence_len"),
        ("context_parallel_size: 8\ncp_comm_strategy: ulysses\n", "cp_comm_strategy='ulysses'"),
        ("cp_comm_strategy: spiral\n", "'cp_comm_strategy'"),
        ("dp_shard_size: 0\n", "'dp_shard_size': must be >= 1"),
        ("lr_scheduler: wavy\n", "'lr_scheduler: wavy': not supported"),
    ],
)
def test_bad_config_one_clear_line(tmp_path, capsys, text, fragment):
    code, _, err = run_cli(capsys, "train", _yaml(tmp_path, "base_model: tiny-llama\n" + text), "--dry-run")
    assert code == 2, err
    assert fragment in err
    assert len(err.strip().splitlines()) == 1, err


def test_bad_config_from_the_shell_exits_2_without_traceback(tmp_path):
    out = _cli("train", _yaml(tmp_path, "dp_shard_sise: 2\n"))
    assert out.returncode == 2
    assert "did you mean 'dp_shard_size'" in out.stderr and "Traceback" not in out.stderr


def test_missing_dataset_is_reported_before_launch(tmp_path, capsys):
    cfg = _yaml(tmp_path, "base_model: tiny-llama\ndatasets: [{path: ./no/such/file.jsonl}]\n")
    code, _, err = run_cli(capsys, "train", cfg)
    assert code == 2 and "datasets[0].path='./no/such/file.jsonl' does not exist" in err


def test_world_size_mismatch_is_reported(capsys):
    code, _, err = run_cli(capsys, "train", "examples/cpu/fsdp.yaml", "--dry-run", "--nproc-per-node", "2")
    assert code == 2 and "needs 4 ranks" in err


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: str(p.relative_to(ROOT / "examples")))
def test_every_example_passes_dry_run(path, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    code, out, err = run_cli(capsys, "train", str(path), "--dry-run")
    assert code == 0, err
    assert "layout" in out and "global batch" in out


def test_set_overrides_nested_and_aliases(tmp_path):
    cfg = load_config(
        _yaml(tmp_path, "tp_size: 2\ncp_size: 2\n"),
        ["fsdp_config.activation_checkpointing=true", "max_steps=7"],
    )
    assert cfg.tensor_parallel_size == 2 and cfg.context_parallel_size == 2
    assert cfg.fsdp_config.activation_checkpointing and cfg.max_steps == 7
    with pytest.raises(ConfigError, match="KEY=VALUE"):
        load_config(None, ["max_steps"])


def test_plot_writes_png(tmp_path, capsys):
    rows = [{"step": i, "loss": 5.0 - i * 0.1, "tokens_per_s": 100.0 + i} for i in range(1, 6)]
    rows.append({"step": 5, "eval_loss": 4.6, "eval_perplexity": 99.5})
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    code, _, err = run_cli(capsys, "plot", str(tmp_path))
    assert code == 0, err
    png = tmp_path / "metrics.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_missing_run_dir(tmp_path, capsys):
    code, _, err = run_cli(capsys, "plot", str(tmp_path / "nope"))
    assert code == 2 and "metrics.jsonl" in err


def test_resume_policy_after_an_elastic_restart():
    from ndparallel.training.trainer import resume_policy

    assert resume_policy(None, {}) is None
    assert resume_policy(None, {"TORCHELASTIC_RESTART_COUNT": "0"}) is None
    assert resume_policy(None, {"TORCHELASTIC_RESTART_COUNT": "1"}) == "auto"
    assert resume_policy("ckpt/checkpoint-4", {"TORCHELASTIC_RESTART_COUNT": "1"}) == "ckpt/checkpoint-4"


def test_one_rank_train_runs_in_this_process_without_an_agent(tmp_path, capsys, monkeypatch):
    """World size 1, no restarts: no elastic agent, no second interpreter; the run and its model
    are those of a launched one, and the rank variables of the caller are left as they were."""
    import ndparallel.runtime.launch as launch

    monkeypatch.setattr(launch, "launch", lambda *a, **k: pytest.fail("the elastic agent was started"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out = tmp_path / "out"
    cfg = _yaml(
        tmp_path,
        f"base_model: tiny-llama\nmax_steps: 2\noutput_dir: {out}\nsequence_len: 32\n"
        f"dataset_cache_dir: {tmp_path / 'cache'}\ntokenizer_vocab_size: 512\n"
        "datasets: [{path: 'builtin:stdlib', max_bytes: 50000}]\n",  # not the whole stdlib: ~10 CPU s
    )
    code, stdout, err = run_cli(capsys, "train", cfg)
    assert code == 0, err[-3000:]
    assert "step 2: loss" in stdout and (out / "final" / "config.json").exists()
    assert "RANK" not in os.environ and "WORLD_SIZE" not in os.environ
    import torch.distributed as dist

    assert not dist.is_initialized()  # its one-rank group is gone with it
    from ndparallel.testing import run_on_ranks

    # ... and its garbage too: a rank forked later that collected it would wait for the run's gloo
    # threads forever (fork copies none), as test_bad_inputs' did
    assert run_on_ranks(_collect_garbage, 1, timeout_s=30) == ["collected"]


def _collect_garbage() -> str:
    import gc

    gc.collect()
    return "collected"


def test_one_rank_train_preempted_before_its_loop_exits_75(monkeypatch):
    import signal

    from ndparallel.runtime.launch import run_here
    from ndparallel.runtime.preemption import PREEMPTED_EXIT

    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(SystemExit) as stopped:
        run_here(lambda: os.kill(os.getpid(), signal.SIGTERM) or 0)
    assert stopped.value.code == PREEMPTED_EXIT
    assert signal.getsignal(signal.SIGTERM) is before
    assert run_here(lambda: 3) == 3


def test_a_bad_config_is_refused_before_torch_is_imported(tmp_path):
    """Reading and refusing a config imports no torch (``optim/names.py``, ``models/nf4_config.py``,
    the preflight imported after the config is read): a typo is answered at once."""
    code = "import sys; from ndparallel.cli import main; print(main(sys.argv[1:]), 'torch' in sys.modules)"
    cfg = _yaml(tmp_path, "base_model: tiny-llama\ndp_shard_sise: 2\n")
    cmd = [sys.executable, "-c", code, "train", cfg]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["2", "False"], out.stdout + out.stderr
    assert "did you mean 'dp_shard_size'" in out.stderr
