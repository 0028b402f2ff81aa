"""Pydantic validation errors of the training config as the one-line messages users see: the key
or field named, the bound and the value, the fix or a did-you-mean."""

from __future__ import annotations

import difflib
from collections.abc import Iterable

from pydantic import AliasChoices, BaseModel, ValidationError


class ConfigError(ValueError):
    """A bad training config; the message is meant to be shown as is."""


_HINTS = {
    "max_steps": "or leave it out to train num_epochs epochs",
    "save_steps": "or leave it out to save no intermediate checkpoint",
    "save_total_limit": "the number of checkpoints kept; leave it out to keep all",
    "eval_steps": "or leave it out to evaluate only at the end",
    "max_grad_norm": "or null for no clipping",
    "max_restarts": "0 = no restart",
    "collective_timeout_s": "seconds a collective may wait",
    "preemption_timeout_s": "seconds from a SIGTERM/SIGUSR1 until the job exits, saved or not",
    "tokenizer_vocab_size": "256 bytes + 2 special tokens + at least one merge",
}


def _suggest(key: str, known: list[str]) -> str:
    close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
    return f"; did you mean '{close[0]}'?" if close else ""


def _known_keys(model: type[BaseModel]) -> list[str]:
    keys = []
    for name, f in model.model_fields.items():
        keys.append(name)
        alias = f.validation_alias
        if isinstance(alias, AliasChoices):
            keys.extend(str(c) for c in alias.choices)
    return keys


def validation_problems(
    err: ValidationError,
    top: type[BaseModel],
    nested: dict[str, type[BaseModel]],
    other_keys: Iterable[str] = (),
) -> list[str]:
    """One line per problem. An unknown key gets a did-you-mean among the keys of ``top`` (then
    ``other_keys``: the keys a front door translates) or, under a field named in ``nested``, of that
    section's model."""
    lines = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"])
        if e["type"] == "extra_forbidden":
            parent = e["loc"][:-1]
            model = nested.get(str(parent[0]), top) if parent else top
            key = str(e["loc"][-1])
            hint = _suggest(key, _known_keys(model)) or ("" if parent else _suggest(key, list(other_keys)))
            lines.append(f"unknown key '{loc}'" + (hint or "; remove it (see the keys in docs/axolotl.md)"))
        else:
            lines.append(f"'{loc}': {_range_message(e)}" if loc else _range_message(e))
    return lines


def join_problems(source: str, lines: list[str]) -> str:
    """``source: problem`` for one; ``source: N problems:`` and one indented line each otherwise."""
    if len(lines) == 1:
        return f"{source}: {lines[0]}"
    return f"{source}: {len(lines)} problems:\n" + "\n".join(f"  {line}" for line in lines)


_BOUNDS = {"greater_than_equal": ">=", "greater_than": ">", "less_than": "<", "less_than_equal": "<="}


def _range_message(e: dict) -> str:
    """``must be >= 1, got 0 (hint)`` for a bound error; pydantic's own text for the others."""
    field = str(e["loc"][-1]) if e["loc"] else ""
    hint = f" ({_HINTS[field]})" if field in _HINTS else ""
    if e["type"] in _BOUNDS:
        bound = next(iter(e["ctx"].values()))
        bound = int(bound) if isinstance(bound, float) and bound.is_integer() else bound
        return f"must be {_BOUNDS[e['type']]} {bound}, got {e.get('input')!r}{hint}"
    if e["type"] == "finite_number":
        return f"must be a finite number, got {e.get('input')!r}{hint}"
    msg = e["msg"].removeprefix("Value error, ")
    return msg if "got" in msg or not e["loc"] else f"{msg} (got {e.get('input')!r})"
