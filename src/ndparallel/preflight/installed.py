"""The optional extras a config asks for, against what is installed here (``runtime/extras.py``):
one line naming what each feature needs and the one ``pip install 'ndparallel[...]'`` that brings
them all. Before any rank starts, ``train``, ``verify``, ``simulate`` and ``launch`` refuse it;
``--dry-run`` (a config perhaps meant for another machine) refuses the features' alike but only
lists the trackers'. Features the config does not ask for need no extra."""

from __future__ import annotations

from ndparallel.config import TrainConfig
from ndparallel.optim.names import is_low_bit
from ndparallel.runtime.extras import EXTRAS, absent, install_line
from ndparallel.tracking.trackers import PIP, is_installed


def feature_extras(cfg: TrainConfig) -> list[tuple[str, str, list[str]]]:
    """(extra, feature, absent packages) of each feature ``cfg`` asks for that needs an extra."""
    wanted: list[tuple[str, str, tuple[str, ...]]] = []
    if cfg.adapter == "qlora" or cfg.load_in_4bit:
        wanted.append(("qlora", f"adapter: {cfg.adapter} with load_in_4bit", EXTRAS["qlora"]))
    elif cfg.adapter:
        wanted.append(("lora", f"adapter: {cfg.adapter}", EXTRAS["lora"]))
    if cfg.fp8:
        wanted.append(("fp8", "fp8: true", EXTRAS["fp8"]))
    if cfg.qat is not None:
        wanted.append(("qat", "qat", EXTRAS["qat"]))
    if is_low_bit(cfg.optimizer):
        wanted.append(("qlora", f"optimizer: {cfg.optimizer}", ("torchao",)))
    return [(extra, feature, absent(modules)) for extra, feature, modules in wanted]


def tracker_extras(names: list[str]) -> list[tuple[str, str, list[str]]]:
    """(``trackers``, the tracker, its package) of each tracker in ``names`` not installed here."""
    return [("trackers", f"the {n} tracker", [PIP.get(n, n)]) for n in names if not is_installed(n)]


def missing_extras(cfg: TrainConfig, trackers: bool = True) -> str | None:
    """The one line for every extra ``cfg``'s features (and ``trackers``) need and lack; None if none."""
    return install_line(feature_extras(cfg) + (tracker_extras(cfg.trackers()) if trackers else []))
