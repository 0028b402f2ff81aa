"""The optional extras of ``pyproject.toml``: which packages a feature needs beyond the core
dependencies, and the one line that says how to install them (``pip install 'ndparallel[lora]'``).

Asked without importing anything (``importlib.util.find_spec``): the checks before launch refuse a
run whose features lack their extras before any rank starts (``preflight/installed.py``: one line
for all of them), and the code that imports such a package raises ``MissingExtra`` (an
``ImportError``) with the same kind of line. ``tests/test_dependencies.py`` checks this table
against pyproject's extras."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterable

EXTRAS: dict[str, tuple[str, ...]] = {
    "plot": ("matplotlib",),
    "lora": ("peft",),
    "qlora": ("peft", "torchao"),
    "fp8": ("torchao",),
    "qat": ("torchao",),
    "trackers": ("wandb", "tensorboardX", "mlflow", "swanlab", "prometheus_client"),
    "hf-tp": ("accelerate",),
    "trainer": ("accelerate",),
    "trl": ("trl", "accelerate"),
}
"""Extra -> the modules it provides (import names)."""

PACKAGES = {"mlflow": "mlflow-skinny", "prometheus_client": "prometheus-client"}
"""Import name -> the distribution to install, where they differ."""


class MissingExtra(ImportError):
    """A feature's package is not installed; the message is one line naming the extra."""


def is_installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package missing, or a module without a spec
        return False


def absent(modules: Iterable[str]) -> list[str]:
    """The distributions to install for those of ``modules`` that are not installed."""
    return [PACKAGES.get(m, m) for m in modules if not is_installed(m)]


def install_line(missing: Iterable[tuple[str, str, list[str]]]) -> str | None:
    """One line for (extra, feature, absent packages) entries: ``"<feature> needs <packages>[; ...],
    not installed here: pip install 'ndparallel[<extras>]'"``; None when nothing is absent."""
    missing = [(extra, feature, packages) for extra, feature, packages in missing if packages]
    if not missing:
        return None
    what = "; ".join(f"{feature} needs {' and '.join(packages)}" for _, feature, packages in missing)
    extras = ",".join(dict.fromkeys(extra for extra, _, _ in missing))
    return f"{what}, not installed here: pip install 'ndparallel[{extras}]'"


def require(extra: str, feature: str, modules: tuple[str, ...] | None = None) -> None:
    """Raise ``MissingExtra`` naming ``extra`` unless its modules (or ``modules``) are installed."""
    line = install_line([(extra, feature, absent(modules or EXTRAS[extra]))])
    if line:
        raise MissingExtra(line)
