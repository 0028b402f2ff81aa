"""Preemption and multi-node, as a cluster runs them: SIGTERM to the launcher of a 4-rank FSDP×TP
``ndparallel train`` checkpoints the step the ranks agreed on and exits 75; the same command then
resumes and ends with the uninterrupted run's losses, exactly (constant LR). Ctrl-C: one line,
exit 130, checkpoints intact. SIGUSR1 to one rank of an Accelerate-style loop stops every rank
after the same step. Two "nodes" (a ``torchrun`` and
an ``ndparallel launch``, c10d rendezvous on 127.0.0.1) × 2 ranks train exactly as one node × 4;
tensor parallelism across the node boundary is refused before launch; ``accelerate launch
--num_machines 2 --machine_rank M --main_process_ip --main_process_port`` places the ranks as
Accelerate does."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ndparallel.checkpoint import list_checkpoints, validate_checkpoint
from ndparallel.runtime.multirank import RankFailure, free_port, run_on_ranks
from ndparallel.runtime.preemption import PREEMPTED_EXIT

sys.path.insert(0, str(Path(__file__).parent / "scripts"))
import ckpt_train  # noqa: E402

from cli_helpers import c10d_nodes, run_cli, train_on_forked_ranks  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
STEPS = 16
CONFIG = f"""\
base_model: tiny-llama
tokenizer_vocab_size: 300
datasets:
  - path: builtin:stdlib
    max_bytes: 60000
sequence_len: 32
micro_batch_size: 1
max_steps: {STEPS}
learning_rate: 1.0e-3
lr_scheduler: constant
optimizer: sgd
logging_steps: 1
device: cpu
save_final_model: false
resume_from_checkpoint: auto
dp_shard_size: 2
tensor_parallel_size: 2
"""
WAIT_S = 300  # generous: 4 ranks start in ~10 s on 2 idle cores, much slower under load


def _env() -> dict:
    return {
        **os.environ,
        "NDPARALLEL_TIMEOUT": "60",
        "NDPARALLEL_DEVICE": "cpu",
        "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
    }


def _config(root: Path, out: str) -> Path:
    path = root / f"{out}.yaml"
    path.write_text(CONFIG + f"output_dir: {root / out}\ndataset_cache_dir: {root / 'cache'}\n")
    return path


def _losses(out: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def _train(cfg: Path, *extra: str) -> subprocess.CompletedProcess:
    """The same ``ndparallel train`` command, its ranks forked from pytest (what resumes is the
    ranks' side; the launches above are the real ones)."""
    return train_on_forked_ranks(
        ["train", cfg, *extra], env={"NDPARALLEL_TIMEOUT": "60", "NDPARALLEL_DEVICE": "cpu"}, timeout_s=WAIT_S
    )


def _train_in_ranks(config: str) -> None:
    from ndparallel.axolotl import load_config
    from ndparallel.training.trainer import run_training

    run_training(load_config(config))


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    """The reference losses of every test here: one node × 4 ranks, uninterrupted — the trainer
    in 4 forked ranks (no start-up cost; the launched runs below must equal it exactly)."""
    root = tmp_path_factory.mktemp("cluster")
    run_on_ranks(_train_in_ranks, 4, str(_config(root, "ref")), timeout_s=WAIT_S)
    losses = _losses(root / "ref")
    assert sorted(losses) == list(range(1, STEPS + 1))
    return root, losses


def _wait_for_step(proc: subprocess.Popen, out: Path, step: int) -> None:
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        assert proc.poll() is None, "the run ended before the signal could be sent"
        if (out / "metrics.jsonl").exists() and max(_losses(out), default=0) >= step:
            return
        time.sleep(0.05)
    pytest.fail(f"step {step} was not logged within {WAIT_S} s")


@pytest.mark.timeout(300)  # a real multi-rank launch, 40-95 s on 2 cores: over the 120 s default budget
def test_sigterm_to_launcher_checkpoints_agreed_step_and_resumes_exactly(work):
    root, reference = work
    cfg, out = _config(root, "preempted"), root / "preempted"
    with open(root / "preempted.err", "w+") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "ndparallel", "train", str(cfg)],
            env=_env(),
            stdout=subprocess.DEVNULL,
            stderr=err,
            text=True,
        )
        _wait_for_step(proc, out, 4)
        proc.send_signal(signal.SIGTERM)
        signalled, again = time.monotonic(), False
        while proc.poll() is None and time.monotonic() - signalled < 60:
            if not again and list(out.glob("checkpoint-*")):  # the save has begun: signal again
                proc.send_signal(signal.SIGTERM)
                again = True
            time.sleep(0.01)
        took = time.monotonic() - signalled
        rc = proc.wait(timeout=5)  # (still running after 60 s: this fails below, naming it)
        err.seek(0)
        stderr = err.read()
    assert rc == PREEMPTED_EXIT and took < 60, (rc, took, stderr[-3000:])
    ((step, ckpt),) = list_checkpoints(out)  # no periodic checkpoint: only the preemption's
    assert step >= 4 and step == max(_losses(out)) and validate_checkpoint(ckpt) == []
    assert f"preempted (SIGTERM) after step {step}: checkpoint saved to {ckpt}" in stderr
    assert "Traceback" not in stderr, stderr[-3000:]

    resumed = _train(cfg)  # the same command again (its ranks forked)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from {ckpt} at step {step}" in resumed.stdout
    assert _losses(out) == reference  # exact, every step


def test_ctrl_c_prints_one_line_and_keeps_the_checkpoints(work):
    """SIGINT to the launcher (what Ctrl-C sends) of a 2-rank run saving every 2 steps: exit 130,
    one "interrupted at step N" line naming the newest complete checkpoint, no traceback."""
    root, _ = work
    cfg, out = _config(root, "interrupted"), root / "interrupted"
    extra = ["--set", "dp_shard_size=1", "--set", "tensor_parallel_size=2", "--set", "save_steps=2"]
    with open(root / "interrupted.err", "w+") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "ndparallel", "train", str(cfg), *extra],
            env=_env(),
            stdout=subprocess.DEVNULL,
            stderr=err,
            text=True,
        )
        _wait_for_step(proc, out, 3)
        proc.send_signal(signal.SIGINT)
        rc = proc.wait(timeout=120)
        err.seek(0)
        stderr = err.read()
    assert rc == 130, stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]
    lines = [line for line in stderr.splitlines() if "interrupted" in line]
    assert len(lines) == 1, stderr[-3000:]
    found = re.fullmatch(
        r"ndparallel train: interrupted at step (\d+) \(Ctrl-C\): the newest complete checkpoint "
        r"is (\S+)/checkpoint-(\d+) \(resume_from_checkpoint: auto continues from it\)",
        lines[0],
    )
    assert found and int(found.group(1)) >= 3 and int(found.group(3)) in (2, 4, 6), lines[0]
    complete = [s for s, p in list_checkpoints(out) if validate_checkpoint(p) == []]
    assert complete and complete[-1] == int(found.group(3))


def test_sigusr1_to_one_rank_of_a_python_loop_stops_all_after_one_step(tmp_path):
    """``acc.preemption()`` (FSDP 2): rank 1 gets SIGUSR1 after step 3; both ranks stop after step
    4 (one step of latency: the agreement all-reduce overlaps a step), checkpoint it, and a resumed
    run ends with the uninterrupted run's losses."""
    layout = {"dp_shard_size": 2}
    ref = run_on_ranks(ckpt_train.train, 2, layout, str(tmp_path / "ref"), steps=6)[0]["losses"]
    out = tmp_path / "run"
    results = run_on_ranks(ckpt_train.train, 2, layout, str(out), steps=6, signal_at=(1, 3))
    assert [r["stopped"] for r in results] == [(4, "a signal to another rank"), (4, "SIGUSR1")]
    assert [s for s, _ in list_checkpoints(out)] == [4] and validate_checkpoint(out / "checkpoint-4") == []
    resumed = run_on_ranks(ckpt_train.train, 2, layout, str(out), steps=6, resume=True)[0]
    assert resumed["losses"] == {5: ref[5], 6: ref[6]}


@pytest.mark.timeout(300)  # a real multi-rank launch, 40-95 s on 2 cores: over the 120 s default budget
def test_two_nodes_of_two_ranks_equal_one_node_of_four(work):
    """Node 0: ``torchrun``; node 1: ``ndparallel launch`` — both torchrun's flags, one c10d
    rendezvous on 127.0.0.1. Asynchronous checkpoints on, every 5 steps."""
    root, reference = work
    cfg, out = _config(root, "two_nodes"), root / "two_nodes"
    rdzv = c10d_nodes(2, f"127.0.0.1:{free_port()}", "two-nodes")
    train = ["-m", "ndparallel", "train", str(cfg), "--set", "checkpoint_async=true", "--set", "save_steps=5"]
    launchers = [
        [sys.executable, "-m", "torch.distributed.run", *rdzv, *train],
        [sys.executable, "-m", "ndparallel", "launch", *rdzv, *train],
    ]
    procs = [
        subprocess.Popen(cmd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for cmd in launchers
    ]
    outputs = [p.communicate(timeout=WAIT_S) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [o[1][-2000:] for o in outputs]
    assert _losses(out) == reference
    assert [s for s, _ in list_checkpoints(out)] == [5, 10, 15]
    assert all(validate_checkpoint(p) == [] for _, p in list_checkpoints(out))


def test_tensor_parallel_across_nodes_refused_before_launch(tmp_path, capsys, monkeypatch):
    """``ndparallel launch`` checks a train command's layout against its nodes before it starts
    anything: asked in this process, with starting the agent failing the test."""
    import ndparallel.runtime.launch as launch

    monkeypatch.setattr(launch, "launch", lambda *a, **k: pytest.fail(f"the job was launched: {a}"))
    cfg = _config(tmp_path, "cross")
    code, _, err = run_cli(
        capsys,
        "launch",
        *c10d_nodes(1, "127.0.0.1:1"),
        "-m",
        "ndparallel",
        "train",
        cfg,
        "--set",
        "dp_shard_size=1",
    )
    assert code == 2
    assert err.strip().splitlines() == [
        "ndparallel launch: error: tensor_parallel_size=2 spans nodes: a node runs 1 rank(s) and a tp group "
        "is 2 "
        "consecutive ranks, so every layer's tensor-parallel all-reduces would cross the inter-node network; "
        "keep "
        "tp within a node (a divisor of 1) and use dp_shard / dp_replicate across nodes"
    ]
    assert not (tmp_path / "cross").exists()  # nothing started


def _accelerator_tp2():
    from ndparallel import Accelerator, ParallelismConfig

    Accelerator(ParallelismConfig(tp_size=2))


def test_accelerator_refuses_tp_across_nodes():
    """Two nodes of one rank each (``LOCAL_WORLD_SIZE=1``): a tp group of 2 would span them."""
    with pytest.raises(RankFailure, match=r"tensor_parallel_size=2 spans nodes: a node runs 1 rank"):
        run_on_ranks(_accelerator_tp2, 2, env={"LOCAL_WORLD_SIZE": "1"}, timeout_s=120)


_ACCELERATE_CONFIG = """\
compute_environment: LOCAL_MACHINE
distributed_type: MULTI_GPU
mixed_precision: 'no'
num_processes: 4
rdzv_backend: static
same_network: true
use_cpu: true
"""


def test_accelerate_launch_on_two_machines(tmp_path):
    """The real ``accelerate launch`` with its multi-machine flags, once per "machine": 4 ranks in
    one group, machine 0 holding ranks 0-1 (its local main process is rank 0), machine 1 ranks
    2-3; tp groups within a machine."""
    import shutil

    if shutil.which("accelerate") is None:
        pytest.skip("the accelerate CLI is not installed")
    (tmp_path / "cfg.yaml").write_text(_ACCELERATE_CONFIG)
    port = str(free_port())
    procs = [
        subprocess.Popen(
            [
                "accelerate",
                "launch",
                "--config_file",
                str(tmp_path / "cfg.yaml"),
                "--num_machines",
                "2",
                "--machine_rank",
                str(m),
                "--main_process_ip",
                "127.0.0.1",
                "--main_process_port",
                port,
                str(ROOT / "tests" / "accelerate_scripts" / "multinode_probe.py"),
                str(tmp_path),
            ],
            env=_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=tmp_path,
        )
        for m in (0, 1)
    ]
    outputs = [p.communicate(timeout=WAIT_S) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [o[1][-2000:] for o in outputs]
    info = [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in range(4)]
    assert [
        (i["process_index"], i["machine"], i["local_process_index"], i["is_local_main_process"]) for i in info
    ] == [(0, 0, 0, True), (1, 0, 1, False), (2, 1, 0, True), (3, 1, 1, False)]
    assert all(i["num_processes"] == 4 and i["sum"] == 6.0 for i in info)
    assert [i["is_main_process"] for i in info] == [True, False, False, False]
    assert [i["tp_group"] for i in info] == [[0, 1], [0, 1], [2, 3], [2, 3]]
