"""Experiment trackers with Hugging Face Accelerate's interface (``GeneralTracker``: ``start``,
``store_init_configuration``, ``log``, ``finish``): a JSON-lines file (no dependency), TensorBoard,
Weights & Biases and MLflow. One set of implementations for both front doors: the Accelerate facade
(``accelerator/tracking.py``: ``log_with``, ``init_trackers``) and ``ndparallel train``
(``run.RunTrackers``: ``output_dir/metrics.jsonl`` plus the trackers the YAML turns on)."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import time
from pathlib import Path
from typing import Any


class GeneralTracker:
    """Base class of trackers: ``name``, ``requires_logging_directory`` and ``tracker`` must be set
    by subclasses; ``main_process_only`` trackers exist on the main process only."""

    main_process_only = True

    def __init__(self, _blank: bool = False):
        if not _blank:
            missing = [a for a in ("name", "requires_logging_directory") if not hasattr(self, a)]
            if missing:
                raise NotImplementedError(f"{type(self).__name__} must define {missing}")

    def start(self) -> None:
        """Open the run (called by ``init_trackers``)."""

    def store_init_configuration(self, values: dict) -> None:
        pass

    def log(self, values: dict, step: int | None = None, **kwargs) -> None:
        pass

    def finish(self) -> None:
        pass

    @property
    def tracker(self):
        return None


def _plain(value: Any) -> Any:
    if hasattr(value, "item") and getattr(value, "numel", lambda: 2)() == 1:
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value if isinstance(value, (int, float, str, bool, type(None), list, dict)) else str(value)


class JSONLTracker(GeneralTracker):
    """``{logging_dir}/{run_name}/metrics.jsonl`` (or ``path``): one JSON object per ``log`` call,
    with ``step`` and ``time``, flushed at once; the run configuration in ``config.json`` beside it."""

    name = "jsonl"
    requires_logging_directory = True

    def __init__(self, run_name: str, logging_dir: str | os.PathLike | None = None, *, path=None, **kwargs):
        super().__init__()
        if kwargs:
            raise ValueError(f"the jsonl tracker takes no init_kwargs, got {sorted(kwargs)}")
        self.path = (
            Path(path) if path is not None else Path(logging_dir or "runs") / run_name / "metrics.jsonl"
        )
        self.dir = self.path.parent
        self._file = None

    def start(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a", encoding="utf-8")

    @property
    def tracker(self):
        return self._file

    def store_init_configuration(self, values: dict) -> None:
        (self.dir / "config.json").write_text(json.dumps({k: _plain(v) for k, v in values.items()}, indent=2))

    def log(self, values: dict, step: int | None = None, **kwargs) -> None:
        record = {"step": step, "time": time.time(), **{k: _plain(v) for k, v in values.items()}}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def finish(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


class TensorBoardTracker(GeneralTracker):
    name = "tensorboard"
    requires_logging_directory = True

    def __init__(self, run_name: str, logging_dir, **kwargs):
        super().__init__()
        self.logging_dir = os.path.join(logging_dir, run_name)
        self.init_kwargs = kwargs

    def start(self) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            from tensorboardX import SummaryWriter
        self.writer = SummaryWriter(self.logging_dir, **self.init_kwargs)

    @property
    def tracker(self):
        return self.writer

    def store_init_configuration(self, values: dict) -> None:
        self.writer.add_hparams({k: _plain(v) for k, v in values.items()}, metric_dict={})
        self.writer.flush()

    def log(self, values: dict, step: int | None = None, **kwargs) -> None:
        for k, v in values.items():
            v = _plain(v)
            if isinstance(v, (int, float)):
                self.writer.add_scalar(k, v, global_step=step, **kwargs)
            elif isinstance(v, str):
                self.writer.add_text(k, v, global_step=step, **kwargs)
            elif isinstance(v, dict):
                self.writer.add_scalars(k, v, global_step=step, **kwargs)
        self.writer.flush()

    def finish(self) -> None:
        self.writer.close()


class _ProjectRunTracker(GeneralTracker):
    """A tracker whose library's ``init(project=run_name, ...)`` returns the run it logs to."""

    module = ""
    requires_logging_directory = False

    def __init__(self, run_name: str, **kwargs):
        super().__init__()
        self.run_name, self.init_kwargs = run_name, kwargs

    def start(self) -> None:
        self.run = importlib.import_module(self.module).init(project=self.run_name, **self.init_kwargs)

    @property
    def tracker(self):
        return self.run

    def finish(self) -> None:
        self.run.finish()


class WandBTracker(_ProjectRunTracker):
    name = module = "wandb"

    def store_init_configuration(self, values: dict) -> None:
        self.run.config.update(values, allow_val_change=True)

    def log(self, values: dict, step: int | None = None, **kwargs) -> None:
        self.run.log(values, step=step, **kwargs)


class MLflowTracker(GeneralTracker):
    name = "mlflow"
    requires_logging_directory = False

    def __init__(self, experiment_name: str, logging_dir=None, tracking_uri: str | None = None, **kwargs):
        super().__init__()
        self.experiment_name, self.tracking_uri, self.init_kwargs = experiment_name, tracking_uri, kwargs

    def start(self) -> None:
        import mlflow

        if self.tracking_uri:
            mlflow.set_tracking_uri(self.tracking_uri)
        mlflow.set_experiment(self.experiment_name)
        self.active_run = mlflow.start_run(**self.init_kwargs)

    @property
    def tracker(self):
        return self.active_run

    def store_init_configuration(self, values: dict) -> None:
        import mlflow

        mlflow.log_params({k: str(v)[:500] for k, v in values.items()})

    def log(self, values: dict, step: int | None = None, **kwargs) -> None:
        import mlflow

        mlflow.log_metrics(
            {k: float(_plain(v)) for k, v in values.items() if isinstance(_plain(v), (int, float))}, step=step
        )

    def finish(self) -> None:
        import mlflow

        mlflow.end_run()


class SwanLabTracker(_ProjectRunTracker):
    """SwanLab (``mode``: online, local, offline — written under ``log_dir``, ``swanlab sync``
    uploads it later — or disabled)."""

    name = module = "swanlab"

    def store_init_configuration(self, values: dict) -> None:
        self.run.config.update({k: _plain(v) for k, v in values.items()})

    def log(self, values: dict, step: int | None = None, **kwargs) -> None:
        numbers = {k: _plain(v) for k, v in values.items() if isinstance(_plain(v), (int, float))}
        self.run.log(numbers, step=step)


class PrometheusTracker(GeneralTracker):
    """A Prometheus scrape endpoint, ``http://host:port/metrics``, holding the run's latest numbers as
    gauges ``ndparallel_<name>`` (loss, learning_rate, grad_norm, eval_loss, tokens_per_s, ...) and
    ``ndparallel_step`` (Axolotl's ``use_otel_metrics`` serves such an endpoint through
    OpenTelemetry's Prometheus reader). Its own registry and server thread: nothing global; port 0
    takes a free port (``url`` says which)."""

    name = "prometheus"
    requires_logging_directory = False

    def __init__(self, host: str = "localhost", port: int = 8000):
        super().__init__()
        self.host, self.port, self.gauges = host, port, {}

    def start(self) -> None:
        from prometheus_client import CollectorRegistry, start_http_server

        self.registry = CollectorRegistry()
        try:
            self.server, self.thread = start_http_server(self.port, addr=self.host, registry=self.registry)
        except OSError as e:
            raise OSError(
                f"the metrics endpoint cannot listen on {self.host}:{self.port} ({e}); set "
                "otel_metrics_port to a free port (0: any)"
            ) from None
        self.url = f"http://{self.host}:{self.server.server_port}/metrics"

    @property
    def tracker(self):
        return self.registry

    def log(self, values: dict, step: int | None = None, **kwargs) -> None:
        from prometheus_client import Gauge

        numbers = {k: _plain(v) for k, v in values.items()}
        if step is not None:
            numbers["step"] = step
        for key, value in numbers.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                name = "ndparallel_" + "".join(c if c.isalnum() else "_" for c in key)
                if name not in self.gauges:
                    self.gauges[name] = Gauge(name, f"{key} (ndparallel train)", registry=self.registry)
                self.gauges[name].set(value)

    def finish(self) -> None:
        self.server.shutdown()
        self.server.server_close()


TRACKERS = {
    "jsonl": JSONLTracker,
    "tensorboard": TensorBoardTracker,
    "wandb": WandBTracker,
    "mlflow": MLflowTracker,
    "swanlab": SwanLabTracker,
    "prometheus": PrometheusTracker,
}
MODULES = {
    "jsonl": (),
    "tensorboard": ("tensorboard", "tensorboardX"),
    "wandb": ("wandb",),
    "mlflow": ("mlflow",),
    "aim": ("aim",),
    "comet_ml": ("comet_ml",),
    "clearml": ("clearml",),
    "dvclive": ("dvclive",),
    "swanlab": ("swanlab",),
    "trackio": ("trackio",),
    "prometheus": ("prometheus_client",),
}
PIP = {
    "tensorboard": "tensorboardX",
    "wandb": "wandb",
    "mlflow": "mlflow-skinny",
    "swanlab": "swanlab",
    "prometheus": "prometheus-client",
}
"""The package to install for each tracker (``pip install 'ndparallel[trackers]'`` has them all)."""


def is_installed(name: str) -> bool:
    mods = MODULES[name]
    return not mods or any(importlib.util.find_spec(m) is not None for m in mods)
