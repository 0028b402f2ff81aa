"""The trackers Axolotl's examples name beyond W&B / TensorBoard / MLflow: SwanLab (offline mode, no
network: its train replay is in test_axolotl_examples_train.py) and the metrics endpoint of
``use_otel_metrics`` (a Prometheus scrape target on otel_metrics_host:otel_metrics_port)."""

import urllib.request

from ndparallel.axolotl import load_config
from ndparallel.tracking.run import RunTrackers


def _scrape(url: str) -> dict[str, float]:
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    return {
        line.split()[0]: float(line.split()[1])
        for line in text.splitlines()
        if line.startswith("ndparallel_")
    }


def test_otel_metrics_serve_the_latest_numbers(tmp_path):
    cfg_path = tmp_path / "c.yaml"
    cfg_path.write_text(
        "base_model: tiny-llama\nuse_otel_metrics: true\notel_metrics_host: 127.0.0.1\n"
        "otel_metrics_port: 0\nswanlab_project: p\nswanlab_mode: offline\n"
    )
    cfg = load_config(cfg_path)
    assert cfg.trackers() == ["swanlab", "prometheus"]
    assert cfg.tracker_kwargs("prometheus", str(tmp_path)) == {"host": "127.0.0.1", "port": 0}
    assert cfg.tracker_kwargs("swanlab", str(tmp_path))["mode"] == "offline"
    run = RunTrackers(tmp_path / "out", cfg, enabled=True, config={"learning_rate": 0.1})
    (endpoint,) = [t for t in run.trackers if t.name == "prometheus"]
    run.write({"step": 3, "loss": 2.5, "learning_rate": 0.01, "note": "text is not a gauge"})
    first = _scrape(endpoint.url)
    assert (
        first["ndparallel_loss"] == 2.5 and first["ndparallel_step"] == 3.0 and "ndparallel_note" not in first
    )
    run.write({"step": 4, "loss": 2.25, "grad_norm": 0.5})
    later = _scrape(endpoint.url)
    assert (
        later["ndparallel_loss"] == 2.25
        and later["ndparallel_step"] == 4.0
        and later["ndparallel_grad_norm"] == 0.5
    )
    run.finish()
    assert list((tmp_path / "out" / "swanlog").rglob("run-*.swanlab"))  # SwanLab's offline run beside it
    try:
        urllib.request.urlopen(endpoint.url, timeout=2)
        raise AssertionError("the endpoint outlived the run")
    except OSError:
        pass


def test_axolotl_cloud_mode_is_swanlab_online(tmp_path):
    cfg_path = tmp_path / "c.yaml"
    cfg_path.write_text("base_model: tiny-llama\nuse_swanlab: true\nswanlab_mode: cloud\n")
    cfg = load_config(cfg_path)
    assert cfg.tracker_kwargs("swanlab", "d")["mode"] == "online" and cfg.trackers() == ["swanlab"]
    cfg_path.write_text("base_model: tiny-llama\nswanlab_project: p\nswanlab_mode: disabled\n")
    assert load_config(cfg_path).trackers() == []  # control: disabled means none
