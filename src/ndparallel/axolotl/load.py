"""The YAML front door: a config file read, ``--set`` overrides applied, Axolotl's keys translated
into ``TrainConfig``'s fields (``translate``) and the result validated."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import AliasChoices, ValidationError

from ndparallel.axolotl.keys import TOP
from ndparallel.axolotl.translate import translate
from ndparallel.config.datasets import DatasetConfig, SpecialTokens
from ndparallel.config.errors import ConfigError, join_problems, validation_problems
from ndparallel.config.fields import FSDPConfig
from ndparallel.config.overrides import apply_override
from ndparallel.config.schema import TrainConfig


def load_config(path: str | Path | None, overrides: list[str] = ()) -> TrainConfig:
    """Read, override (``--set key=value``, dotted keys for nested fields), translate Axolotl's keys
    (``translate``: its notes are kept for ``--dry-run``) and validate. Every problem found is
    one line of the ``ConfigError``."""
    data: dict[str, Any] = {}
    source = str(path) if path else "config"
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {p} not found")
        try:
            data = yaml.safe_load(p.read_text())
        except yaml.YAMLError as e:
            raise ConfigError(f"{p}: not valid YAML: {e}") from None
        if data is None or data == {}:
            raise ConfigError(
                f"{p} is empty: write at least base_model and datasets (or run ndparallel train "
                "without a config for the built-in quickstart)"
            )
        if not isinstance(data, dict):
            raise ConfigError(f"{p}: the top level must be a mapping of keys to values")
    for item in overrides:
        apply_override(data, item)
    found = translate(data, own_keys())
    problems = list(found.problems)
    cfg = None
    try:
        cfg = TrainConfig.model_validate(found.data)
    except ValidationError as e:
        problems += [
            _as_written(line, found.renamed) for line in validation_problems(e, TrainConfig, NESTED, TOP)
        ]
    if problems:
        raise ConfigError(join_problems(source, problems))
    cfg._axolotl_notes = found.notes
    return cfg


NESTED = {
    "fsdp_config": FSDPConfig,
    "datasets": DatasetConfig,
    "pretraining_dataset": DatasetConfig,
    "special_tokens": SpecialTokens,
}


def _as_written(problem: str, renamed: dict[str, str]) -> str:
    """A schema problem about a renamed key's value names the key as the config wrote it."""
    for target, source in renamed.items():
        if problem.startswith(f"'{target}'"):
            return f"'{source}'" + problem[len(target) + 2 :]
    return problem


def own_keys() -> set[str]:
    """Top-level keys TrainConfig reads itself (field names and aliases)."""
    keys = set()
    for name, f in TrainConfig.model_fields.items():
        keys.add(name)
        if isinstance(f.validation_alias, AliasChoices):
            keys.update(str(c) for c in f.validation_alias.choices)
    return keys
