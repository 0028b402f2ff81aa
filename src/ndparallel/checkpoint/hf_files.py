"""The files of a Hugging Face model directory besides the weights: ``config.json``, a copied
``generation_config.json``, the tokenizer; and the keys the weights are stored under
(``saved_tensors``). Shared by every export (full, adapter, merged)."""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any

import torch

GENERATION_CONFIG = "generation_config.json"


def write_hf_config(model_or_config: Any, directory: Path, dtype: torch.dtype | None, class_name: str | None) -> None:
    """The model's (or config's) ``config.json``, naming ``class_name`` and ``dtype`` when given."""
    config = copy.deepcopy(getattr(model_or_config, "config", model_or_config))
    if class_name:
        config.architectures = [class_name]
    if dtype is not None:
        config.dtype = dtype
    config.save_pretrained(directory)


def saved_tensors(model: Any, name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """What transformers' ``save_pretrained`` writes for the model tensor ``name``: the model's key
    conversion reversed (``transformers.core_model_loading.revert_weight_conversion``). Most tensors
    keep their name; a mixture-of-experts model's fused expert weights (``experts.gate_up_proj``)
    become the per-expert tensors of its published checkpoints (``experts.0.gate_proj.weight`` ...;
    Mixtral's ``block_sparse_moe.experts.0.w1.weight`` ...), which transformers fuses again on load.
    One tensor at a time: the pieces are copies, so the full tensor can be freed."""
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:  # transformers < 5: no key conversion
        return [(name, tensor)]
    out = revert_weight_conversion(model, {name: tensor})
    if len(out) == 1 and name in out:
        return [(name, tensor)]
    return [(k, v.clone() if v._base is not None or v.data_ptr() == tensor.data_ptr() else v)
            for k, v in out.items()]


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
