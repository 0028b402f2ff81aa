"""The files of a Hugging Face model directory besides the weights: ``config.json``, a copied
``generation_config.json``, the tokenizer. Shared by every export (full, adapter, merged)."""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any

import torch

GENERATION_CONFIG = "generation_config.json"


def write_hf_config(
    model_or_config: Any, directory: Path, dtype: torch.dtype | None, class_name: str | None
) -> None:
    """The model's (or config's) ``config.json``, naming ``class_name`` and ``dtype`` when given."""
    config = copy.deepcopy(getattr(model_or_config, "config", model_or_config))
    if class_name:
        config.architectures = [class_name]
    if dtype is not None:
        config.dtype = dtype
    config.save_pretrained(directory)


def copy_generation_config(source_dir: Path, directory: Path) -> None:
    """``source_dir``'s ``generation_config.json`` into ``directory``, when there is one."""
    src = Path(source_dir) / GENERATION_CONFIG
    if src.is_file():
        (Path(directory) / GENERATION_CONFIG).write_text(src.read_text())


def save_tokenizer(tokenizer: Any, directory: Path) -> None:
    """A tokenizer object, or a tokenizer directory / Hub id (loaded first), saved into ``directory``;
    nothing when ``tokenizer`` is None."""
    if tokenizer is None:
        return
    if isinstance(tokenizer, (str, os.PathLike)):
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(tokenizer)
    tokenizer.save_pretrained(directory)
