"""Growing a pretrained model's vocabulary (tokens added to its tokenizer) while it is loaded
sharded: which weights have a row per token, and the new rows' values.

New rows start at the mean of the existing rows (input embedding and LM head alike): a new token
then looks like an average token instead of a random one, which keeps the first steps' loss and
gradients close to the base model's (Hewitt, "Initializing new word embeddings", 2021; transformers'
``resize_token_embeddings(mean_resizing=True)`` adds noise around the same mean). Deterministic:
every layout and every rank compute the same rows.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn as nn

from ndparallel.models.key_conversion import checkpoint_keys
from ndparallel.models.weights import read_header


def vocab_weight_names(model: nn.Module) -> list[str]:
    """Names of the weights with one row per token: the input embedding's and, when not tied to
    it, the output head's (``state_dict`` names of ``model``)."""
    wanted = []
    for get in ("get_input_embeddings", "get_output_embeddings"):
        module = getattr(model, get, lambda: None)()
        if module is not None and isinstance(getattr(module, "weight", None), torch.Tensor):
            wanted.append(module.weight)
    names, seen = [], set()
    for name, p in model.named_parameters(remove_duplicate=False):
        if any(p is w for w in wanted) and id(p) not in seen:
            seen.add(id(p))
            names.append(name)
    return names


def grow_rows(weight: torch.Tensor, rows: int) -> torch.Tensor:
    """``weight`` ([old_rows, d]) with rows appended up to ``rows``, each the mean of the old rows
    (computed in fp32, stored in ``weight``'s dtype)."""
    old = weight.shape[0]
    if rows < old:
        raise ValueError(f"cannot shrink a vocabulary of {old} rows to {rows}")
    mean = weight.float().mean(dim=0, keepdim=True).to(weight.dtype)
    return torch.cat([weight, mean.expand(rows - old, -1)], dim=0)


def grow_config_vocab(config, vocab_size: int | None, lora: bool = False) -> bool:
    """Whether the model needs more token rows than its checkpoint has (then ``config`` says so;
    a multimodal config: its text config)."""
    config = config.get_text_config()
    if vocab_size is None or vocab_size == config.vocab_size:
        return False
    if vocab_size < config.vocab_size:
        raise ValueError(
            f"vocab_size={vocab_size} is smaller than the model's {config.vocab_size}: "
            "a vocabulary only grows"
        )
    if lora:
        raise ValueError(
            "adding tokens to a LoRA run: the new embedding rows would stay frozen at their "
            "initial value; add them in a full fine-tune (or use tokens the vocabulary has)"
        )
    config.vocab_size = vocab_size
    return True


def set_grown_rows(model: nn.Module, files: list[Path], names: list[str], rows: int) -> None:
    """Rank 0 reads the checkpoint's token-row weights, appends the new rows (``grow_rows``) and
    broadcasts them one tensor at a time; each rank keeps its shard (one full weight in memory on
    rank 0 plus one in flight, not one per rank)."""
    import torch.distributed as dist
    from safetensors import safe_open
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
    )

    distributed = dist.is_available() and dist.is_initialized()
    full: dict[str, torch.Tensor] = {}
    if not distributed or dist.get_rank() == 0:
        dtypes = {n: p.dtype for n, p in model.named_parameters(remove_duplicate=False)}
        stored = {k: (v["dtype"], v["shape"]) for f in files for k, v in read_header(f).items()}
        where = checkpoint_keys(model, stored).direct  # model name -> stored name (GPT-NeoX: embed_out)
        for f in files:
            with safe_open(str(f), framework="pt") as handle:
                for n in names:
                    if where.get(n, n) in handle.keys():
                        full[n] = grow_rows(handle.get_tensor(where.get(n, n)).to(dtypes[n]), rows)
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=distributed, strict=False)
    set_model_state_dict(model, full, options=options)
