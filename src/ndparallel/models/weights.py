"""Do a model directory's safetensors files fit its config? Checked from the files' headers (names,
dtypes, shapes, byte ranges) against the state dict of the model built on the meta device: no
tensor data is read, so it costs milliseconds for any model size and runs before any rank starts.

Found: a file that is not safetensors, a truncated file (a tensor's bytes end past the file's
end), tensors the model needs that no file holds (renamed keys, another architecture), and
shapes that differ from what ``config.json`` implies. Tensors in the files that the model does not
use are ignored, as transformers does.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from ndparallel.models.checkpoint_formats import prequantized_problem
from ndparallel.models.key_conversion import checkpoint_keys, stored_shape
from ndparallel.models.naming import tied_aliases

_MAX_HEADER = 100 * 2**20  # the safetensors format caps its JSON header at 100 MB


def read_header(file: str | os.PathLike, with_data_start: bool = False):
    """The JSON header of a safetensors file (``name -> {dtype, shape, data_offsets}``), checked
    against the file's size (with ``with_data_start``: also the byte offset where tensor data
    starts). ``ValueError`` naming the file when it is not safetensors or is truncated. The one
    reader of safetensors headers (the checks, the key listing and the slice reads use it)."""
    file = Path(file)
    size = file.stat().st_size
    with open(file, "rb") as f:
        head = f.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else -1
        if n <= 0 or n > _MAX_HEADER:
            raise ValueError(f"{file} is not a safetensors file (its first 8 bytes are no header length)")
        if 8 + n > size:
            raise ValueError(f"{file} is truncated ({size} bytes, its header alone needs {8 + n})")
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"{file} is not a safetensors file (its header is not JSON: {e})") from None
    if not isinstance(header, dict):
        raise ValueError(f"{file} is not a safetensors file (its header is not a JSON object)")
    header.pop("__metadata__", None)
    end = max((int(v["data_offsets"][1]) for v in header.values()), default=0)
    if 8 + n + end > size:
        raise ValueError(
            f"{file} is truncated: {size} bytes, its tensors need {8 + n + end} "
            "(an interrupted download or copy?); fetch the file again"
        )
    return (header, 8 + n) if with_data_start else header


def weights_problem(
    model: torch.nn.Module, files: list[Path], config_name: str = "config.json", grown: list[str] = ()
) -> str | None:
    """Why the safetensors ``files`` cannot fill ``model`` (built on any device, meta included,
    from ``config_name``), or None. Keys are matched as transformers converts them
    (``key_conversion``: renamed and fused tensors). Tied aliases may be absent, as
    ``save_pretrained`` omits them; the ``grown`` weights (token rows added) may have fewer rows
    than the model."""

    stored: dict[str, tuple[str, list[int], str]] = {}
    for f in files:
        for name, info in read_header(f).items():
            stored[name] = (info["dtype"], list(info["shape"]), f.name)
    prequantized = prequantized_problem(getattr(model, "config", None), stored)
    if prequantized:
        return f"{str(files[0].parent)!r}: {prequantized}"
    try:
        plan = checkpoint_keys(model, {k: v[:2] for k, v in stored.items()})
    except ValueError as e:
        return f"{e} ({str(files[0].parent)!r})"
    except Exception as e:  # noqa: BLE001 - a transformers converter that cannot combine these tensors
        return (
            f"the checkpoint's tensors cannot be converted to {type(model).__name__}'s as transformers "
            f"would ({type(e).__name__}: {' '.join(str(e).split())[:200]})"
        )
    aliases = set(tied_aliases(model))
    expected = {k: list(v.shape) for k, v in model.state_dict().items() if k not in aliases}
    missing = [k for k in expected if not plan.has(k)]
    if missing:
        return (
            f"{len(missing)} model tensor(s) are not in the checkpoint {str(files[0].parent)!r}, e.g. "
            f"{missing[:3]}; its keys look like {sorted(stored)[:3]} (a checkpoint of another "
            "architecture or with renamed keys?)"
        )

    def fits(k: str, shape: list[int]) -> bool:
        have = stored_shape(plan, stored, k)
        if k in grown:
            return len(have) == len(shape) and have[1:] == shape[1:] and have[0] <= shape[0]
        return have == shape

    wrong = [(k, shape) for k, shape in expected.items() if not fits(k, shape)]
    if wrong:
        (name, want), more = wrong[0], len(wrong) - 1
        where = (
            f"in {stored[plan.direct[name]][2]}"
            if name in plan.direct
            else f"built from {sum(map(len, plan.fused[name].sources.values()))} stored tensors"
        )
        return (
            f"tensor {name!r} {where} has shape {stored_shape(plan, stored, name)}, but {config_name} "
            f"gives the model {want}"
            + (f" (and {more} more tensors differ)" if more else "")
            + ": the weights do not match the config (sizes edited, or another model's config?)"
        )
    return None
