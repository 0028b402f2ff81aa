"""Planner calibration: the alpha-beta fit, and a quick measurement on 2 forked gloo ranks."""

import json

import pytest

from ndparallel.plan.calibrate import calibrate, fit_alpha_beta
from ndparallel.plan.cli import main
from ndparallel.plan.comms import collective_time
from ndparallel.plan.hardware import Hardware, load_hardware_file


@pytest.mark.parametrize("kind", ["all_gather", "reduce_scatter", "all_reduce", "send_recv"])
def test_fit_recovers_ring_model(kind):
    hw = Hardware("x", 1, 1, 1, 1, intra_node_bw=5e9, inter_node_bw=5e9, intra_node_latency=3e-5,
                  link_efficiency=1.0)
    sizes = [2**12, 2**16, 2**20, 2**24]
    times = [collective_time(kind, b, 4, hw, True) for b in sizes]
    fit = fit_alpha_beta(kind, 4, sizes, times)
    assert fit["alpha_s"] == pytest.approx(3e-5, rel=1e-6)
    assert fit["bus_bw"] == pytest.approx(5e9, rel=1e-6)


def test_quick_cpu_calibration_feeds_the_planner(tmp_path, capsys):
    profile = calibrate(ranks=2, quick=True, device="cpu")
    hw = Hardware.from_dict(profile["hardware"])
    assert hw.peak_flops > 0 and hw.peak_flops_fp32 > 0 and hw.hbm_bw > 0
    assert set(hw.collectives) == {"all_gather", "reduce_scatter", "all_reduce", "send_recv"}
    assert all(v["2"]["bus_bw"] > 0 for v in hw.collectives.values())
    path = tmp_path / "cpu.json"
    path.write_text(json.dumps(profile))
    assert load_hardware_file(path) == hw
    assert main(["--model", "tiny", "--gpus", "2", "--gpus-per-node", "2", "--hardware-file",
                 str(path), "--seq-len", "256", "--global-batch-size", "8",
                 "--mixed-precision", "fp32", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert len(data["ranked"]) == 4  # 2x1x1x1, 1x2x1x1, 1x1x2x1, 1x1x1x2
