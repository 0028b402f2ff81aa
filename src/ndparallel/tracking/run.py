"""``ndparallel train``'s metrics: ``output_dir/metrics.jsonl`` always (what ``ndparallel plot``
reads), plus the trackers its config turns on (Weights & Biases, TensorBoard, MLflow, SwanLab), all written
by the main rank through the same tracker classes as the Accelerate facade's."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

from ndparallel.tracking.trackers import TRACKERS, GeneralTracker, JSONLTracker


class TrackerConfig(Protocol):
    """What a run's config tells about its trackers (``config.fields.TrackerFields``)."""

    def trackers(self) -> list[str]: ...

    def tracker_kwargs(self, name: str, run_dir: str) -> dict[str, Any]: ...


def make_tracker(name: str, kwargs: dict[str, Any]) -> GeneralTracker:
    kwargs = dict(kwargs)
    if name in ("wandb", "swanlab"):
        return TRACKERS[name](kwargs.pop("project"), **kwargs)
    if name == "tensorboard":
        return TRACKERS[name]("", kwargs.pop("logging_dir"), **kwargs)
    if name == "prometheus":
        return TRACKERS[name](**kwargs)
    return TRACKERS[name](kwargs.pop("experiment_name"), **kwargs)


class RunTrackers:
    """``write(record)`` sends a record (with its ``step``) to every tracker; ``finish()`` closes
    them. Nothing happens on ranks other than the main one. ``fresh``: a new run starts a new
    ``metrics.jsonl`` (a resumed one appends)."""

    def __init__(
        self,
        out_dir: str | Path,
        cfg: TrackerConfig,
        enabled: bool,
        fresh: bool = True,
        config: dict | None = None,
    ):
        self.path = Path(out_dir) / "metrics.jsonl"
        self.trackers: list[GeneralTracker] = []
        if not enabled:
            return
        if fresh and self.path.exists():
            self.path.unlink()
        self.trackers.append(JSONLTracker("", path=self.path))
        for name in cfg.trackers():
            self.trackers.append(make_tracker(name, cfg.tracker_kwargs(name, str(out_dir))))
        for tracker in self.trackers:
            tracker.start()
            if config is not None and not isinstance(tracker, JSONLTracker):
                tracker.store_init_configuration(config)

    def write(self, record: dict) -> None:
        values = {k: v for k, v in record.items() if k != "step"}
        for tracker in self.trackers:
            tracker.log(values, step=record.get("step"))

    def finish(self) -> None:
        for tracker in self.trackers:
            tracker.finish()
        self.trackers = []
