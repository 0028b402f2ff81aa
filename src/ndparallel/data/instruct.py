"""User-defined instruction formats: Axolotl's ``type: {field_instruction: ..., format: ...}``.

A record's instruction, optional input and optional system text are put into the ``format``
strings; the result is the prompt (not trained unless ``train_on_inputs``), the output column is
the answer (trained, then eos)::

    prompt = system_format.format(system=...)          # when there is a system text
           + format.format(instruction=..., input=...)  # when the input is non-empty (spaces count)
             or no_input_format.format(instruction=...) # otherwise

Unset keys take Axolotl's defaults: ``format: "{instruction} {input} "``, ``no_input_format:
"{instruction} "``, ``system_format: "{system}"``, columns ``instruction``, ``input``, ``output`` and
``system``. The system text is the record's ``field_system`` column when present and not null, else
``system_prompt`` (Axolotl gives a null one no system text at all: docs/axolotl.md's differences).
Placeholders other than these are refused when the config is read.
"""

from __future__ import annotations

import string
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

USER_DEFINED = "user_defined"
"""The internal type name of a dataset whose ``type`` is such a mapping."""

_PLACEHOLDERS = {
    "format": {"instruction", "input"},
    "no_input_format": {"instruction"},
    "system_format": {"system"},
}


@dataclass(frozen=True)
class InstructFormat:
    format: str = "{instruction} {input} "
    no_input_format: str = "{instruction} "
    field_instruction: str = "instruction"
    field_input: str | None = "input"
    field_output: str = "output"
    field_system: str | None = "system"
    system_prompt: str = ""
    system_format: str = "{system}"

    @classmethod
    def from_mapping(cls, d: Mapping[str, Any], where: str) -> InstructFormat:
        """Validated: known keys, text values, only the placeholders each string may use."""
        known = [f.name for f in fields(cls)]
        unknown = sorted(set(d) - set(known))
        if unknown:
            raise ValueError(f"{where}: unknown key(s) {unknown} in a custom format; allowed: {known}")
        values = {k: v for k, v in d.items() if v is not None}
        for key, value in values.items():
            if not isinstance(value, str):
                raise ValueError(f"{where}.{key}: must be text, got {value!r}")
        for key, allowed in _PLACEHOLDERS.items():
            if key in values:
                used = _placeholders(values[key], f"{where}.{key}")
                if used - allowed:
                    raise ValueError(
                        f"{where}.{key}: placeholder(s) {sorted(used - allowed)} are not filled; "
                        f"use {sorted('{' + a + '}' for a in allowed)} (literal braces: {{{{ }}}})"
                    )
        return cls(**values)

    def required_columns(self) -> list[tuple[str, ...]]:
        return [(self.field_instruction,), (self.field_output,)]


def _placeholders(text: str, where: str) -> set[str]:
    try:
        return {name for _, name, _, _ in string.Formatter().parse(text) if name is not None}
    except ValueError as e:  # an unmatched brace
        raise ValueError(f"{where}: {e} in {text!r} (literal braces are written {{{{ and }}}})") from None


def render_prompt(record: Mapping[str, Any], fmt: InstructFormat, where: str) -> tuple[str, str]:
    """(prompt, output) of one record."""

    def text(column: str | None, required: bool) -> str:
        value = record.get(column) if column else None
        if value is None:
            if required:
                raise ValueError(f"{where}: column {column!r} is missing or null")
            return ""
        if not isinstance(value, str):
            raise ValueError(f"{where}: column {column!r} is a {type(value).__name__}, not text")
        return value

    instruction, extra = text(fmt.field_instruction, True), text(fmt.field_input, False)
    system = (
        text(fmt.field_system, False)
        if fmt.field_system and record.get(fmt.field_system) is not None
        else fmt.system_prompt
    )
    prompt = fmt.system_format.format(system=system) if system else ""
    if extra:
        prompt += fmt.format.format(instruction=instruction, input=extra)
    else:
        prompt += fmt.no_input_format.format(instruction=instruction)
    return prompt, text(fmt.field_output, True)
