"""``ndparallel plan`` bad input: one line ``ndparallel plan: error: --flag ...: fix``, exit 2, no
traceback, for every numeric flag out of range (the planner's share of issue #14)."""

import json
import subprocess
import sys

import pytest

from ndparallel.plan.cli.main import main

BASE = ["--base-model", "llama-3.2-1b", "--gpus", "8", "--sequence-len", "2048"]


def _run(argv) -> int:
    """``main``'s exit code; argparse's own type errors end in SystemExit."""
    try:
        return main(argv)
    except SystemExit as exc:
        return exc.code


@pytest.mark.parametrize(
    "extra, flag",
    [
        (["--sequence-len", "0"], "--sequence-len"),
        (["--sequence-len", "-5"], "--sequence-len"),
        (["--gpus-per-node", "0"], "--gpus-per-node"),
        (["--gpus", "12"], "--gpus 12 with --gpus-per-node 8"),
        (["--gpus", "0"], "--gpus"),
        (["--global-batch-size", "0"], "--global-batch-size"),
        (["--global-batch-tokens", "-2048"], "--global-batch-tokens"),
        (["--global-batch-tokens", "3000"], "--global-batch-tokens"),
        (["--micro-batch-size", "0"], "--micro-batch-size"),
        (["--micro-batch-size", "two"], "--micro-batch-size"),
        (["--matmul-efficiency", "7"], "--matmul-efficiency"),
        (["--matmul-efficiency", "0"], "--matmul-efficiency"),
        (["--peak-tflops", "-3"], "--peak-tflops"),
        (["--intra-node-bw", "0"], "--intra-node-bw"),
        (["--inter-node-bw", "-1"], "--inter-node-bw"),
        (["--hbm-bw", "-1"], "--hbm-bw"),
        (["--gpu-mem", "96MB"], "--gpu-mem"),
        (["--gpu-mem", "lots"], "--gpu-mem"),
        (["--gpu-mem", "0"], "--gpu-mem"),
        (["--top", "0"], "--top"),
        (["--loss-chunk-tokens", "0"], "--loss-chunk-tokens"),
        (["--write-config", "/no/such/dir/plan.yaml"], "--write-config"),
        (["--hardware-file", "/no/such/hw.json"], "--hardware-file"),
        (["--sequence-len", "abc"], "--sequence-len"),
        (["--explain", "zz=2"], "zz"),
        (["--explain", "pipeline_parallel_size=2,dp_shard_size=4,pipeline_schedule=Fast"], "schedule"),
        (["--pipeline-schedule", "Fast"], "--pipeline-schedule"),
        (["--pipeline-virtual-stages", "0"], "--pipeline-virtual-stages"),
    ],
)
def test_bad_flag_one_line_exit_2(extra, flag, capsys):
    code = _run(BASE + extra)
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert len(err.splitlines()) == 1, err
    assert err.startswith("ndparallel plan: error: ") and flag in err, err
    assert "Traceback" not in err


def test_bad_flag_through_main_cli_no_traceback():
    proc = subprocess.run(
        [sys.executable, "-m", "ndparallel", "plan", *BASE, "--sequence-len", "0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip() == "ndparallel plan: error: --sequence-len 0: must be a whole number >= 1"


def test_gpu_mem_bare_number_is_gib(capsys):
    """``--gpu-mem 96`` is 96 GiB (it used to be 96 bytes, rejecting every layout)."""
    assert (
        main(
            BASE
            + ["--gpus", "1", "--gpus-per-node", "1", "--gpu-mem", "96", "--json", "--global-batch-size", "4"]
        )
        == 0
    )
    data = json.loads(capsys.readouterr().out)
    assert data["hardware"]["mem_bytes"] == 96 * 2**30
    assert data["ranked"], "a 1B model fits 96 GiB"
    assert main(BASE + ["--gpu-mem", "80GB", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["hardware"]["mem_bytes"] == 80 * 2**30


def test_write_config_into_a_directory_is_refused(tmp_path, capsys):
    assert main(BASE + ["--write-config", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "--write-config" in err and "is a directory" in err


def test_help_groups_the_flags_by_concern():
    """Each run flag sits in the ``--help`` group the flag table gives it (``plan/cli/flags.py``),
    next to the other flags of the same concern, the groups in ``GROUPS``' order."""
    import re

    from ndparallel.plan.cli.flags import GROUPS
    from ndparallel.plan.cli.parser import make_parser

    text = make_parser().format_help()
    starts = [text.index(f"\n{g}:\n") for g in GROUPS]
    assert starts == sorted(starts)
    sections = dict(zip(GROUPS, (text[a:b] for a, b in zip(starts, [*starts[1:], len(text)]))))
    expected = {
        "batch, checkpointing and precision": [
            "--sequence-len",
            "--micro-batch-size",
            "--activation-checkpointing",
        ],
        "communication and kernels": ["--sequence-parallel", "--cp-comm-strategy", "--cp-kernel"],
        "adapters and quantisation": ["--qat", "--adapter", "--lora-r"],
        "long context": ["--tiled-mlp", "--tiled-mlp-num-shards", "--activation-offloading", "--host-mem"],
        "pipeline": ["--pipeline-schedule", "--pipeline-virtual-stages", "--no-pipeline-parallel"],
    }
    for group, flags in expected.items():
        found = set(re.findall(r"^  (--[a-z-]+)", sections[group], re.M))
        assert set(flags) <= found, (group, found)


def test_help_shows_the_training_configs_keys():
    """Every run flag of ``plan --help`` is a training config's key (``--sequence-len`` for
    ``sequence_len``), or one of the few the planner names otherwise, each with its reason
    (``Settings``' ``NAMED_OTHERWISE``); the older spellings are not shown."""
    import re

    from ndparallel.config.fields import FSDPConfig
    from ndparallel.config.schema import TrainConfig
    from ndparallel.plan.cli.flags import DEPRECATED, FLAGS
    from ndparallel.plan.cli.parser import make_parser
    from ndparallel.plan.settings import NAMED_OTHERWISE

    yaml_keys = set(TrainConfig.model_fields) | set(FSDPConfig.model_fields)
    text = make_parser().format_help()
    for flag in FLAGS:
        assert flag.option in text
        assert flag.key in yaml_keys or flag.key in NAMED_OTHERWISE, flag.key
    assert "--base-model" in text and not set(DEPRECATED) & set(re.findall(r"--[a-z-]+", text))


@pytest.mark.parametrize(
    "old, new",
    [
        (["--model", "llama-3.2-1b"], ["--base-model", "llama-3.2-1b"]),
        (["--seq-len", "1024"], ["--sequence-len", "1024"]),
        (["--micro-batch", "2"], ["--micro-batch-size", "2"]),
        (["--cp-strategy=allgather"], ["--cp-comm-strategy=allgather"]),
        (["--loss-impl", "full"], ["--no-chunked-loss"]),
        (["--fused-adamw"], ["--optimizer", "adamw_torch_fused"]),
    ],
)
def test_todays_spellings_still_work_with_a_note(old, new, capsys):
    """An older flag gives the same answer as its new spelling, and says once which that is."""
    argv = ["--gpus", "8", "--json", "--top", "1"]
    base = [] if "--model" in old else ["--base-model", "llama-3.2-1b"]
    assert main(base + new + argv) == 0
    want = capsys.readouterr()
    assert want.err == ""
    assert main(base + old + argv) == 0
    got = capsys.readouterr()
    assert got.out == want.out
    name = old[0].split("=")[0]
    said = {
        "--loss-impl": "--chunked-loss / --no-chunked-loss",
        "--fused-adamw": "--optimizer adamw_torch_fused",
    }
    use = said.get(name, new[0].split("=")[0])
    assert got.err == f"ndparallel plan: note: {name} is deprecated: use {use} (the training config's key)\n"


def test_the_searched_settings_are_shown_and_a_flag_pins_one(capsys):
    """--json gives each row's chosen settings, the table names them, --explain counts the options
    it compared, and a flag pins its setting on every row (issue 61)."""
    from ndparallel.plan.search.request import SEARCHED

    args = ["--base-model", "llama-3.1-8b", "--gpus", "8", "--gpu", "h100-80gb", "--sequence-len", "8192"]
    assert main([*args, "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["ranked"]
    assert all(set(r["chosen"]) == set(SEARCHED) for r in rows)
    assert {r["chosen"]["activation_checkpointing"] for r in rows} == {False, True}
    assert main([*args, "--ac-policy", "selective", "--activation-checkpointing", "on", "--json"]) == 0
    pinned = json.loads(capsys.readouterr().out)["ranked"]
    assert pinned and {
        (r["chosen"]["ac_policy"], r["chosen"]["activation_checkpointing"]) for r in pinned
    } == {("selective", True)}
    assert main([*args, "--top", "3"]) == 0
    assert "AC, settings" in capsys.readouterr().out
    assert main([*args, "--explain", "1x8x1x1,micro_batch_size=1"]) == 0
    out = capsys.readouterr().out
    assert "Options of this layout (10 compared)" in out and "selective, offloaded" in out
