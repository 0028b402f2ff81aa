"""Planner calibration: the alpha-beta fit, the kernel measurements over the model's own shapes
on CPU, one-rank calibration (collectives not measured), and the profile through --hardware-file."""

import json

import pytest

from ndparallel.layout.dims import ParallelDims
from ndparallel.plan.calibrate.measure import calibrate, fit_alpha_beta
from ndparallel.plan.cli.main import main
from ndparallel.plan.hardware import Hardware, load_hardware_file
from ndparallel.plan.models import PRESETS
from ndparallel.plan.settings import Settings
from ndparallel.plan.time.gemm import gemm_shapes
from ndparallel.plan.time.links import collective_time


@pytest.mark.parametrize("kind", ["all_gather", "reduce_scatter", "all_reduce", "send_recv"])
def test_fit_recovers_ring_model(kind):
    hw = Hardware(
        "x", 1, 1, 1, 1, intra_node_bw=5e9, inter_node_bw=5e9, intra_node_latency=3e-5, link_efficiency=1.0
    )
    sizes = [2**12, 2**16, 2**20, 2**24]
    times = [collective_time(kind, b, 4, hw, True) for b in sizes]
    fit = fit_alpha_beta(kind, 4, sizes, times)
    assert fit["alpha_s"] == pytest.approx(3e-5, rel=1e-6)
    assert fit["bus_bw"] == pytest.approx(5e9, rel=1e-6)


def test_quick_cpu_calibration_feeds_the_planner(tmp_path, capsys):
    profile = calibrate(ranks=2, quick=True, device="cpu", model=PRESETS["tiny"], seq_len=64, micro_batch=2)
    hw = Hardware.from_dict(profile["hardware"])
    assert hw.peak_flops > 0 and hw.peak_flops_fp32 > 0 and hw.hbm_bw > 0
    assert set(hw.collectives) == {"all_gather", "reduce_scatter", "all_reduce", "send_recv", "all_to_all"}
    assert all(v["2"]["bus_bw"] > 0 for v in hw.collectives.values())
    # every GEMM shape of the tiny model at 2 × 64 tokens (tp 1) was timed
    measured = {(r["m"], r["n"], r["k"]) for r in hw.gemm_table}
    assert measured == set(gemm_shapes(PRESETS["tiny"], ParallelDims(), Settings(64, 2)))
    assert all(r["flops_per_s"] > 0 for r in hw.gemm_table)
    assert "16" in hw.attention_efficiency and all(x > 0 for x in hw.attention_efficiency["16"])
    assert set(hw.cp_block_efficiency) == {"math", "flash"}
    assert 0 < hw.broadcast_efficiency and hw.host_op_s > 0
    path = tmp_path / "cpu.json"
    path.write_text(json.dumps(profile))
    assert load_hardware_file(path) == hw
    assert load_hardware_file(path).gemm_table == hw.gemm_table  # compare=False fields too
    assert (
        main(
            [
                "--base-model",
                "tiny",
                "--gpus",
                "2",
                "--gpus-per-node",
                "2",
                "--hardware-file",
                str(path),
                "--sequence-len",
                "256",
                "--global-batch-size",
                "8",
                "--mixed-precision",
                "fp32",
                "--json",
            ]
        )
        == 0
    )
    data = json.loads(capsys.readouterr().out)
    assert len(data["ranked"]) == 5  # 2x1x1x1, 1x2x1x1, 1x1x2x1, 1x1x1x2, pp2:1x1x1x1
    assert data["hardware"]["gemm_table"] == hw.gemm_table


def test_one_rank_calibration_keeps_link_figures(tmp_path, capsys):
    out = tmp_path / "one.json"
    assert (
        main(
            [
                "--calibrate",
                "--calibrate-ranks",
                "1",
                "--quick",
                "--base-model",
                "tiny",
                "--sequence-len",
                "64",
                "--micro-batch-size",
                "2",
                "--calibrate-out",
                str(out),
            ]
        )
        == 0
    )
    text = capsys.readouterr().out
    assert "collectives not measured" in text and "--hardware-file" in text
    profile = json.loads(out.read_text())
    assert profile["hardware"]["collectives"] == {}
    assert "collectives not measured" in profile["measurements"]["note"]
    # the profile plans: an explained layout uses its measured GEMMs
    assert (
        main(
            [
                "--base-model",
                "tiny",
                "--gpus",
                "1",
                "--hardware-file",
                str(out),
                "--sequence-len",
                "64",
                "--micro-batch-size",
                "2",
                "--global-batch-size",
                "2",
                "--explain",
                "1x1x1x1",
                "--json",
            ]
        )
        == 0
    )
    best = json.loads(capsys.readouterr().out)["best"]
    assert best["time_s"]["compute_parts"]["gemm"] > 0


def test_reference_h200_profile_loads():
    """The profile --calibrate wrote on the project's H200 (bench/reference) is a valid
    --hardware-file: 1 GPU, so its collectives are empty and its links are the preset's."""
    from pathlib import Path

    path = Path(__file__).parents[1] / "bench" / "reference" / "h200_profile.json"
    hw = load_hardware_file(path)
    assert hw.collectives == {} and hw.intra_node_bw == 450e9
    assert 0.7 < hw.matmul_efficiency < 0.85 and len(hw.gemm_table) == 39
