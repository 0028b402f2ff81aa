"""``--set a.b=value`` / ``--set datasets.0.path=value``: overrides applied to the raw config mapping."""

from __future__ import annotations

from typing import Any

import yaml

from ndparallel.config.errors import ConfigError


def parse_override(text: str) -> tuple[list[str], Any]:
    """``a.b=value`` → (['a', 'b'], YAML-parsed value)."""
    if "=" not in text:
        raise ConfigError(f"--set {text!r}: expected KEY=VALUE, e.g. --set max_steps=20")
    key, raw = text.split("=", 1)
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError as e:
        problem = " ".join(str(getattr(e, "problem", None) or e).split())
        raise ConfigError(
            f"--set {text!r}: the value is not valid YAML ({problem}); quote a string, "
            "e.g. --set 'key=\"[1,\"'"
        ) from None
    return key.strip().split("."), value


def _child(node, key: str, item: str, kind: type):
    """``node[key]`` for ``--set a.0.b=...`` (a list index when ``key`` is a number), created empty."""
    if isinstance(node, list):
        if not key.isdigit() or int(key) >= len(node):
            raise ConfigError(f"--set {item}: '{key}' is not an index of a list of {len(node)} entries")
        return node[int(key)]
    if not isinstance(node, dict):
        raise ConfigError(f"--set {item}: '{key}' is not a mapping (it holds {node!r})")
    return node.setdefault(key, kind())


def _assign(node, key: str, value, item: str) -> None:
    if isinstance(node, list):
        if not key.isdigit() or int(key) > len(node):
            raise ConfigError(f"--set {item}: '{key}' is not an index of a list of {len(node)} entries")
        node[int(key) : int(key) + 1] = [value]
    elif isinstance(node, dict):
        node[key] = value
    else:
        raise ConfigError(f"--set {item}: cannot set '{key}' inside {node!r}")


def apply_override(data: dict, item: str) -> None:
    """Apply one ``KEY=VALUE`` to ``data`` (dotted keys for nested fields, numbers index lists)."""
    keys, value = parse_override(item)
    node = data
    for k, child in zip(keys[:-1], keys[1:]):
        node = _child(node, k, item, list if child.isdigit() else dict)
    _assign(node, keys[-1], value, item)
