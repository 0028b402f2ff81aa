"""The training config's ``datasets:`` entries and ``special_tokens``."""

from __future__ import annotations

import difflib
from typing import Literal

from pydantic import Field, field_validator

from ndparallel.config.base import _int, _Strict


class DatasetConfig(_Strict):
    path: str
    type: str | dict | None = None
    """Raw text (text, json, parquet, csv, completion, pretrain) or alpaca, chat_template, input_output,
    jeopardy, or a custom instruction format {format, no_input_format, field_instruction, ...}
    (docs/data.md)."""
    ds_type: Literal["text", "json", "parquet", "csv"] | None = None
    """The file format when ``type`` is not one (default: from the extension)."""
    split: str = "train"
    text_field: str = "text"
    name: str | None = None
    sample_by: Literal["document", "paragraph", "line"] = "document"
    max_files: _int(1) | None = None
    max_bytes: _int(1) | None = None
    # chat_template (Axolotl's names and defaults)
    field_messages: str | None = None
    message_property_mappings: dict[str, str] | None = None
    roles_to_train: list[str] = Field(default_factory=lambda: ["assistant"])
    train_on_eos: Literal["turn", "all", "last", "none"] = "turn"
    train_on_eot: Literal["turn", "all", "last", "none"] | None = None
    chat_template: str | None = None
    chat_template_jinja: str | None = None
    drop_system_message: bool = False
    """chat_template: leave the conversations' system messages out."""
    field_thinking: str | None = None
    """chat_template: the message key holding the reasoning text (trained with the answer)."""
    template_thinking_key: str | None = None
    """chat_template: the key the template reads the reasoning from (default: field_thinking)."""
    roles: dict[str, list[str]] | None = None
    """chat_template: the role names of the data for each template role, e.g. {assistant: [gpt, bot]}."""
    data_files: list[str] | None = None
    """Files of a Hub dataset (or of a local directory) to read, instead of all of them."""
    skip: _int(0) | None = None
    """pretraining_dataset: records skipped at the start of the stream."""

    @field_validator("data_files", mode="before")
    @classmethod
    def _one_or_more(cls, v):
        return [v] if isinstance(v, str) else v

    @field_validator("split")
    @classmethod
    def _split(cls, v):
        import datasets

        try:
            datasets.ReadInstruction.from_spec(v)
        except (ValueError, AssertionError):
            raise ValueError(
                f"{v!r} is not a split; write e.g. train, train[:20%] or train[100:200]"
            ) from None
        return v

    @field_validator("type", mode="before")
    @classmethod
    def _known_type(cls, v):
        from ndparallel.data.dataset import TYPES

        if isinstance(v, dict):
            from ndparallel.data.instruct import InstructFormat

            InstructFormat.from_mapping(v, "type")  # ValueError: named by pydantic's location
            return v
        if v is not None and v not in TYPES:
            close = difflib.get_close_matches(str(v), TYPES, n=1, cutoff=0.6)
            hint = f"did you mean {close[0]!r}? " if close else ""
            if v == "sharegpt":  # Axolotl's old name
                hint = "use chat_template (it reads ShareGPT's from/value messages); "
            raise ValueError(f"unknown type {v!r}; {hint}use one of {list(TYPES)}")
        return v


class SpecialTokens(_Strict):
    """Tokens set on the tokenizer (each must already be in its vocabulary)."""

    bos_token: str | None = None
    eos_token: str | None = None
    pad_token: str | None = None
    unk_token: str | None = None
    additional_special_tokens: list[str] | None = None
    """Added as special tokens (never split, kept when decoding with skip_special_tokens=False)."""
