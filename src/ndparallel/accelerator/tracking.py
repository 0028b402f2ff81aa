"""Experiment trackers with Accelerate's interface (``log_with``, ``init_trackers``, ``log``,
``get_tracker``, ``end_training``); the tracker implementations live in ``ndparallel.tracking``
(shared with ``ndparallel train``). A JSON-lines file is always written (no dependency); TensorBoard,
Weights & Biases and MLflow are used when requested and installed. A requested tracker that is not
installed gets one warning and is skipped, as in Accelerate; one that is installed but not
implemented here is an error. Custom trackers: subclass ``GeneralTracker``."""

from __future__ import annotations

import warnings

from ndparallel.accelerator.accelerator_state import LoggerType
from ndparallel.runtime.distributed import shutdown
from ndparallel.tracking.trackers import MODULES as _MODULES
from ndparallel.tracking.trackers import (  # noqa: F401  (Accelerate's import paths)
    TRACKERS,
    GeneralTracker,
    JSONLTracker,
    MLflowTracker,
    TensorBoardTracker,
    WandBTracker,
    is_installed,
)


def filter_trackers(log_with, logging_dir=None, warn: bool = True) -> list:
    """The trackers to start for ``log_with``: JSON lines always, then each requested one that is
    installed (one warning for each that is not), custom ``GeneralTracker`` instances as given."""
    requested = (
        [] if log_with is None else (list(log_with) if isinstance(log_with, (list, tuple)) else [log_with])
    )
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
                    how = "pip install 'ndparallel[trackers]'" if n in TRACKERS else f"pip install {n}"
                    warnings.warn(
                        f"log_with={n!r}: {n} is not installed, so it is skipped ({how}); "
                        "metrics still go to the jsonl tracker",
                        stacklevel=3,  # the user's Accelerator(log_with=...): its __init__, this function
                    )
                continue
            if n not in TRACKERS:
                raise ValueError(
                    f"log_with={n!r} is installed but not supported by ndparallel: use one of "
                    f"{sorted(TRACKERS)}, or pass a GeneralTracker subclass instance"
                )
            if TRACKERS[n].requires_logging_directory and n != "jsonl" and logging_dir is None:
                raise ValueError(
                    f"Logging with `{n}` requires a `logging_dir`: pass project_dir= or "
                    "project_config=ProjectConfiguration(logging_dir=...)"
                )
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

        for tracker in self.trackers:
            tracker.finish()
        self.trackers = []
        shutdown()
