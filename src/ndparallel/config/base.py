"""What every section of the training config is built on: a strict pydantic model (unknown keys
refused, null = not set) and bounded integers."""

from __future__ import annotations

import types
import typing
from typing import Annotated

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, model_validator


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True, protected_namespaces=())

    @model_validator(mode="before")
    @classmethod
    def _null_is_unset(cls, data):
        """``key:`` with no value (null) on a field that cannot be null means "not set": the default
        (Axolotl's configs leave placeholders such as ``lora_r:`` empty)."""
        if isinstance(data, dict):
            names = _non_nullable_keys(cls)
            data = {k: v for k, v in data.items() if not (v is None and k in names)}
        return data


def _non_nullable_keys(model: type[BaseModel]) -> set[str]:
    keys = set()
    for name, f in model.model_fields.items():
        args = typing.get_args(f.annotation)
        nullable = f.annotation is type(None) or type(None) in args or f.annotation is typing.Any
        if isinstance(f.annotation, types.UnionType) or typing.get_origin(f.annotation) is typing.Union:
            nullable = nullable or type(None) in args
        if not nullable:
            keys.add(name)
            if isinstance(f.validation_alias, AliasChoices):
                keys.update(str(c) for c in f.validation_alias.choices)
    return keys


def _int(ge: int):
    return Annotated[int, Field(ge=ge)]
