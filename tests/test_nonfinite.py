"""A diverging run stops with a message naming the step and exits non-zero; it never writes a
checkpoint or final model of the diverged weights. ``on_nonfinite: skip`` skips such steps."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ndparallel.engine.nonfinite import NonFiniteError, NonFiniteGuard

ROOT = Path(__file__).resolve().parents[1]
SMALL = [
    "base_model=tiny-llama",
    "datasets=[{path: 'builtin:stdlib', max_bytes: 100000}]",
    "tokenizer_vocab_size=512",
    "sequence_len=32",
    "dp_shard_size=2",
]


def test_stop_mode_names_the_first_bad_step_only_when_checked():
    guard = NonFiniteGuard("stop")
    one = torch.tensor(1.0)
    assert guard.step_is_finite(1, one, one)
    guard.check()
    assert guard.step_is_finite(2, torch.tensor(float("nan")), one)  # no host sync, no raise yet
    assert guard.step_is_finite(3, one, torch.tensor(float("inf")))
    with pytest.raises(NonFiniteError, match="^step 2: the loss or the gradient norm is not finite"):
        guard.check()


def test_skip_mode_skips_then_gives_up():
    guard = NonFiniteGuard("skip", max_consecutive_skips=2)
    nan, one = torch.tensor(float("nan")), torch.tensor(1.0)
    with pytest.warns(UserWarning, match="skipped"):
        assert not guard.step_is_finite(1, nan, one)
    assert guard.step_is_finite(2, one, one) and guard.consecutive == 0
    with pytest.warns(UserWarning):
        assert not guard.step_is_finite(3, one, nan)
        assert not guard.step_is_finite(4, one, nan)
        with pytest.raises(NonFiniteError, match="3 steps in a row"):
            guard.step_is_finite(5, one, nan)


def test_huge_learning_rate_stops_the_run_with_exit_1(tmp_path):
    out = tmp_path / "run"
    sets = [
        *SMALL,
        "learning_rate=1e12",
        "max_grad_norm=null",
        "max_steps=12",
        "logging_steps=4",
        "save_steps=4",
        f"output_dir={out}",
        f"dataset_cache_dir={tmp_path / 'cache'}",
    ]
    cmd = [sys.executable, "-m", "ndparallel", "train", *[a for s in sets for a in ("--set", s)]]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-3000:]
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("ndparallel train: error:")]
    assert len(errors) == 1 and "is not finite" in errors[0] and "step " in errors[0], proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert not (out / "final").exists()
    assert not list(out.glob("checkpoint-*")), "a diverged model was checkpointed"
