"""Experiment trackers with Accelerate's interface (``log_with``, ``init_trackers``, ``log``,
``get_tracker``, ``end_training``). A JSON-lines file is always written (no dependency); TensorBoard,
Weights & Biases and MLflow are used when requested and installed. A requested tracker that is not
installed gets one warning and is skipped, as in Accelerate; one that is installed but not
implemented here is an error. Custom trackers: subclass ``GeneralTracker``."""

from __future__ import annotations

import enum
import importlib.util
import json
import math
import os
import time
import warnings
from pathlib import Path
from typing import Any


class LoggerType(str, enum.Enum):
    ALL = "all"
    JSONL = "jsonl"
    AIM = "aim"
    TENSORBOARD = "tensorboard"
    WANDB = "wandb"
    COMETML = "comet_ml"
    MLFLOW = "mlflow"
    CLEARML = "clearml"
    DVCLIVE = "dvclive"
    SWANLAB = "swanlab"
    TRACKIO = "trackio"

    def __str__(self) -> str:
        return self.value

    @classmethod
    def list(cls) -> list[str]:
        return [m.value for m in cls]


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
    """``{logging_dir}/{run_name}/metrics.jsonl``: one JSON object per ``log`` call, with ``step``
    and ``time``; the run configuration in ``config.json`` beside it."""

    name = "jsonl"
    requires_logging_directory = True

    def __init__(self, run_name: str, logging_dir: str | os.PathLike | None = None, **kwargs):
        super().__init__()
        if kwargs:
            raise ValueError(f"the jsonl tracker takes no init_kwargs, got {sorted(kwargs)}")
        self.dir = Path(logging_dir or "runs") / run_name
        self.path = self.dir / "metrics.jsonl"
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


class WandBTracker(GeneralTracker):
    name = "wandb"
    requires_logging_directory = False

    def __init__(self, run_name: str, **kwargs):
        super().__init__()
        self.run_name, self.init_kwargs = run_name, kwargs

    def start(self) -> None:
        import wandb

        self.run = wandb.init(project=self.run_name, **self.init_kwargs)

    @property
    def tracker(self):
        return self.run

    def store_init_configuration(self, values: dict) -> None:
        self.run.config.update(values, allow_val_change=True)

    def log(self, values: dict, step: int | None = None, **kwargs) -> None:
        self.run.log(values, step=step, **kwargs)

    def finish(self) -> None:
        self.run.finish()


class MLflowTracker(GeneralTracker):
    name = "mlflow"
    requires_logging_directory = False

    def __init__(self, experiment_name: str, logging_dir=None, **kwargs):
        super().__init__()
        self.experiment_name, self.init_kwargs = experiment_name, kwargs

    def start(self) -> None:
        import mlflow

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

        mlflow.log_metrics({k: float(_plain(v)) for k, v in values.items()
                            if isinstance(_plain(v), (int, float))}, step=step)

    def finish(self) -> None:
        import mlflow

        mlflow.end_run()


TRACKERS = {"jsonl": JSONLTracker, "tensorboard": TensorBoardTracker, "wandb": WandBTracker,
            "mlflow": MLflowTracker}
_MODULES = {"jsonl": (), "tensorboard": ("tensorboard", "tensorboardX"), "wandb": ("wandb",),
            "mlflow": ("mlflow",), "aim": ("aim",), "comet_ml": ("comet_ml",), "clearml": ("clearml",),
            "dvclive": ("dvclive",), "swanlab": ("swanlab",), "trackio": ("trackio",)}


def is_installed(name: str) -> bool:
    mods = _MODULES[name]
    return not mods or any(importlib.util.find_spec(m) is not None for m in mods)


def filter_trackers(log_with, logging_dir=None, warn: bool = True) -> list:
    """The trackers to start for ``log_with``: JSON lines always, then each requested one that is
    installed (one warning for each that is not), custom ``GeneralTracker`` instances as given."""
    requested = [] if log_with is None else (list(log_with) if isinstance(log_with, (list, tuple)) else [log_with])
    out: list = ["jsonl"]
    for item in requested:
        if isinstance(item, GeneralTracker):
            out.append(item)
            continue
        name = str(getattr(item, "value", item)).lower()
        # "all": every installed tracker ndparallel implements
        names = [n for n in TRACKERS if n != "jsonl" and is_installed(n)] if name == "all" else [name]
        if name not in _MODULES and name != "all":
            raise ValueError(f"Unsupported logging capability: {item}. Choose between {LoggerType.list()}")
        for n in names:
            if n in out:
                continue
            if not is_installed(n):
                if warn:
                    warnings.warn(f"log_with={n!r}: {n} is not installed, so it is skipped (pip install {n}); "
                                  "metrics still go to the jsonl tracker")
                continue
            if n not in TRACKERS:
                raise ValueError(f"log_with={n!r} is installed but not supported by ndparallel: use one of "
                                 f"{sorted(TRACKERS)}, or pass a GeneralTracker subclass instance")
            if TRACKERS[n].requires_logging_directory and n != "jsonl" and logging_dir is None:
                raise ValueError(f"Logging with `{n}` requires a `logging_dir`: pass project_dir= or "
                                 "project_config=ProjectConfiguration(logging_dir=...)")
            out.append(n)
    return out


class TrackingMixin:
    def init_trackers(self, project_name: str, config: dict | None = None, init_kwargs: dict | None = None):
        """Start the trackers (main process only) and store ``config`` in each."""
        if not self.is_main_process:
            return
        init_kwargs = init_kwargs or {}
        for spec in self.log_with:
            if isinstance(spec, GeneralTracker):
                tracker = spec
            elif TRACKERS[spec].requires_logging_directory:
                tracker = TRACKERS[spec](project_name, self.logging_dir, **init_kwargs.get(spec, {}))
            else:
                tracker = TRACKERS[spec](project_name, **init_kwargs.get(spec, {}))
            tracker.start()
            self.trackers.append(tracker)
        if config is not None:
            for tracker in self.trackers:
                tracker.store_init_configuration(config)

    def get_tracker(self, name: str, unwrap: bool = False):
        if self.trackers:
            for tracker in self.trackers:
                if tracker.name == name:
                    return tracker.tracker if unwrap else tracker
            raise ValueError(f"{name} is not an available tracker stored inside the `Accelerator`.")
        return GeneralTracker(_blank=True)

    def log(self, values: dict, step: int | None = None, log_kwargs: dict | None = None) -> None:
        """Log ``values`` to every tracker (main process only)."""
        if not self.is_main_process:
            return
        for tracker in self.trackers:
            tracker.log(values, step=step, **(log_kwargs or {}).get(tracker.name, {}))

    def end_training(self) -> None:
        """Finish the trackers, then destroy the process group (as Accelerate does)."""
        from ndparallel.runtime.distributed import shutdown

        for tracker in self.trackers:
            tracker.finish()
        self.trackers = []
        shutdown()
