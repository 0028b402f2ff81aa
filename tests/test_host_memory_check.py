"""Before launch, with ``activation_offloading``: the ranks' offloaded activations against this
machine's host memory (``preflight/host_memory.py``). The bytes are the planner's for the rank that
holds the most (equal to ``plan --explain``'s: tests/test_plan_from_config.py, Meta's 405B layout);
over the runtime's budget (80 % of the available memory, shared by the ranks here)
the run is told at once, with the fix, before any rank starts."""

from __future__ import annotations

from pathlib import Path

import pytest

from cli_helpers import forbid_launch, run_cli
from ndparallel.axolotl import load_config
from ndparallel.preflight.checks import run_checks
from ndparallel.preflight.host_memory import host_memory_note, offloaded
from ndparallel.techniques.host_budget import host_budget

ROOT = Path(__file__).resolve().parents[1]
META_405B = ROOT / "examples/gpu/llama-3.1-405b-meta-layout.yaml"
GiB = 2**30


@pytest.fixture(scope="module")
def meta_405b():
    """Meta's 405B layout at its own world (8,192 ranks, PP 16 × FSDP 64 × TP 8): (cfg, pc, hf)."""
    cfg = load_config(str(META_405B))
    found = run_checks(cfg, 8192, check_local=False)
    return cfg, found.pc, found.hf


def test_a_node_short_of_host_memory_is_told_with_the_fix(meta_405b):
    cfg, pc, hf = meta_405b
    need = offloaded(cfg, pc, hf).host_bytes  # 57.8 GiB per GPU
    small = int(8 * need / 0.8) - GiB  # 8 ranks: just short of the budget
    note = host_memory_note(cfg, pc, hf, 8, small)
    assert note is not None and note.startswith("activation_offloading: the 8 rank(s) on this machine")
    assert f"{8 * need / GiB:.1f} GiB of pinned host memory" in note
    assert f"beyond {host_budget(8, small) / GiB:.2f} GiB per rank" in note
    assert "micro_batch_size" in note and "--host-mem" in note
    assert host_memory_note(cfg, pc, hf, 8, small + 2 * GiB) is None  # enough: nothing said
    assert host_memory_note(cfg, pc, hf, 8, None) is None  # unknown (no /proc/meminfo): nothing said
    assert host_memory_note(cfg.model_copy(update={"activation_offloading": False}), pc, hf, 8, 1) is None


def test_train_says_it_before_the_ranks_start(tmp_path, capsys, monkeypatch):
    """``ndparallel train`` of a tiny offloading run on a machine with 1 KiB available: the note is
    printed before launch (the launch itself replaced here: the note is what is tested)."""
    import ndparallel.preflight.checks as checks

    forbid_launch(monkeypatch)
    monkeypatch.setattr(checks, "available_host_memory", lambda: 1024)
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(
        "base_model: tiny-llama\ntokenizer_vocab_size: 300\ndatasets:\n  - path: builtin:stdlib\n"
        "    max_bytes: 20000\nsequence_len: 64\nmicro_batch_size: 1\nmax_steps: 1\ndevice: cpu\n"
        f"dp_shard_size: 2\nactivation_offloading: true\nfsdp_config: {{activation_checkpointing: true}}\n"
        f"output_dir: {tmp_path / 'out'}\ndataset_cache_dir: {tmp_path / 'cache'}\n"
    )
    with pytest.raises(AssertionError, match="ranks were launched"):
        run_cli(capsys, "train", cfg)
    out = capsys.readouterr().out
    notes = [line for line in out.splitlines() if "note: activation_offloading: the 2 rank(s)" in line]
    assert len(notes) == 1, out
