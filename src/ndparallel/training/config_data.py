"""Parts of the training config: its error type, the ``datasets:`` entries, ``special_tokens``, and
the Axolotl names it understands or refuses with a fix."""

from __future__ import annotations

import difflib
from typing import Annotated, Literal

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, field_validator


class ConfigError(ValueError):
    """A bad training config; the message is meant to be shown as is."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True, protected_namespaces=())


def _int(ge: int):
    return Annotated[int, Field(ge=ge)]


class DatasetConfig(_Strict):
    path: str
    type: str | dict | None = None
    """Raw text (text, json, parquet, csv, completion, pretrain) or alpaca, chat_template, input_output,
    or a custom instruction format {format, no_input_format, field_instruction, ...} (docs/data.md)."""
    ds_type: Literal["text", "json", "parquet", "csv"] | None = None
    """The file format when ``type`` is not one (default: from the extension)."""
    split: str = "train"
    text_field: str = Field("text", validation_alias=AliasChoices("text_field", "field"))
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


KNOWN_PLUGINS = {"CutCrossEntropyPlugin"}
"""Axolotl plugins (class names) this config understands."""

UNSUPPORTED = {
    "gradient_checkpointing": "use fsdp_config.activation_checkpointing: true",
    "fsdp": "the FSDP settings live in fsdp_config (see docs/data.md, Axolotl configs)",
    "deepspeed": "DeepSpeed is not used here; ndparallel shards with FSDP2 (fsdp_config)",
    "wandb_project": "no W&B logging; metrics go to output_dir/metrics.jsonl (ndparallel plot draws them)",
    "evals_per_epoch": "use eval_steps",
    "eval_sample_packing": "evaluation uses the training rows' layout; remove it",
    "xformers_attention": "xformers is not supported; use attn_implementation: sdpa or flash_attention_2",
}
"""Axolotl keys with no meaning here: the fix instead of a did-you-mean."""
