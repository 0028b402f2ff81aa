"""One entry of a ``datasets:`` list (``DatasetSpec``) and the dataset types and file formats it
names (``dataset.py`` loads it; its docstring says what each type means)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from .corpus import BUILTIN_STDLIB
from .instruct import USER_DEFINED, InstructFormat

FORMATS: dict[str, tuple[str, ...]] = {
    "text": (".txt", ".text", ".md"),
    "json": (".json", ".jsonl", ".ndjson"),
    "parquet": (".parquet",),
    "csv": (".csv",),
}
RAW_TYPES = (*FORMATS, "completion", "pretrain")
"""Types whose samples are raw text, every token trained."""
PROMPT_TYPES = ("alpaca", "chat_template", "input_output", "jeopardy")
"""Fine-tuning types: records rendered to a prompt and a trained part (``prompts.py``)."""
ALPACA_STYLES = ("instruct", "chat", "chatml", "phi")
"""``alpaca:<style>``: Axolotl's Alpaca prompt styles (``prompts.ALPACA_TURNS``)."""
TYPES = (*RAW_TYPES, *PROMPT_TYPES, *(f"alpaca:{s}" for s in ALPACA_STYLES))


@dataclass(frozen=True)
class DatasetSpec:
    """One entry of the ``datasets:`` list."""

    path: str
    type: str | None = None  # one of TYPES; None = raw text, format from the extension
    split: str = "train"
    text_field: str = "text"
    name: str | None = None  # Hub dataset config name
    sample_by: str = "document"  # plain-text files: document | paragraph | line
    max_files: int | None = None  # builtin:stdlib caps
    max_bytes: int | None = None
    ds_type: str | None = None  # file format (Axolotl's name) when type is not one
    # chat_template (Axolotl's names and defaults)
    field_messages: str | None = None  # None: "messages", else "conversations"
    message_property_mappings: dict | None = None  # {"role": ..., "content": ...}
    roles_to_train: tuple[str, ...] = ("assistant",)
    train_on_eos: str = "turn"  # turn | all | last | none
    train_on_eot: str | None = None  # the same choices for end-of-turn tokens; None: as train_on_eos
    chat_template: str | None = None  # a built-in name, "tokenizer_default", or None (the run's)
    chat_template_jinja: str | None = None
    drop_system_message: bool = False  # chat_template: system messages left out
    field_thinking: str | None = None  # chat_template: the message key holding the reasoning text
    template_thinking_key: str | None = None  # ... and the key the template reads it from
    roles: dict | None = None  # chat_template: {template role: [names in the data]}
    format: InstructFormat | None = None  # type user_defined (a mapping in the config): instruct.py
    data_files: tuple[str, ...] | None = None  # files of a Hub dataset or a local directory to read
    skip: int | None = None  # pretraining_dataset: records skipped at the start of the stream

    @property
    def base_type(self) -> str | None:
        """``type`` without Axolotl's ``:<style>`` suffix (``alpaca:chat`` -> ``alpaca``)."""
        return self.type.split(":", 1)[0] if isinstance(self.type, str) else self.type

    @property
    def split_name(self) -> str:
        """The split a slice such as ``train[:20%]`` is taken from."""
        return self.split.split("[", 1)[0].split("+", 1)[0].strip()

    @property
    def raw(self) -> bool:
        """Raw text (every token trained), not a fine-tuning format."""
        return self.type is None or self.type in RAW_TYPES

    @classmethod
    def from_any(cls, spec: DatasetSpec | Mapping[str, Any] | str, where: str = "dataset") -> DatasetSpec:
        """Build from a spec, a dict (``field`` accepted as alias of ``text_field``) or a path."""
        if isinstance(spec, DatasetSpec):
            return spec
        if isinstance(spec, (str, os.PathLike)):
            return cls(path=str(spec))
        d = dict(spec)
        if "field" in d:
            d.setdefault("text_field", d.pop("field"))
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(
                f"{where}: unknown key(s) {unknown}; allowed: {sorted(known)} ('field' = text_field)"
            )
        if "path" not in d:
            raise ValueError(
                f"{where}: 'path' is required (a file, a directory, {BUILTIN_STDLIB!r} or a Hub name)"
            )
        d["path"] = str(d["path"])
        if isinstance(d.get("type"), Mapping):  # Axolotl's custom instruction format
            d["format"] = InstructFormat.from_mapping(d.pop("type"), f"{where}.type")
            d["type"] = USER_DEFINED
        if isinstance(d.get("roles_to_train"), list):
            d["roles_to_train"] = tuple(d["roles_to_train"])
        if isinstance(d.get("data_files"), (list, str)):
            d["data_files"] = tuple(
                [d["data_files"]] if isinstance(d["data_files"], str) else d["data_files"]
            )
        return cls(**{k: v for k, v in d.items() if v is not None or k not in _NOT_NULL})


_NOT_NULL = {"split", "text_field", "sample_by", "roles_to_train", "train_on_eos", "drop_system_message"}
