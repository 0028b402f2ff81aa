"""Read a model's weights from safetensors files into its (possibly sharded) parameters.

``load_sharded_safetensors`` fills every parameter of a parallelised model from the files through
torch.distributed.checkpoint: DCP plans one read per DTensor shard (any layout, resharding
included) and ``SliceReader`` (a ``HuggingFaceStorageReader`` with its I/O replaced) reads each
slice with ``pread`` straight into the shard. The stock reader goes through
``safe_open(...).get_slice`` on an mmap: every page it touches stays in the rank's RSS until the
file is closed, and each slice is first copied into a temporary tensor, so a rank peaked at about
2 × model/N (all of the model for one file on one rank: 2.3 × model measured). With ``pread`` a
rank holds its shards plus one bounded temporary (only for dtype conversion or strided slices).
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.nn as nn
from torch.distributed.checkpoint import HuggingFaceStorageReader
from torch.futures import Future

from ndparallel.models.adapters import checkpoint_key, is_adapter_param
from ndparallel.models.weights import read_header


def load_sharded_safetensors(model: nn.Module, path: Path, files: list[Path], skip: set[str] = frozenset()) -> None:
    """Fill every parameter and persistent buffer of ``model`` (plain tensors or DTensor shards)
    from the safetensors files in ``path``, reading only this rank's slices (DCP resharding).

    Collective: every rank of the default group must call it. Tied parameters are read once,
    under the key the checkpoint holds (``save_pretrained`` omits ``lm_head.weight`` when tied).
    ``skip``: names left for the caller (grown token rows)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        set_model_state_dict,
    )

    ckpt_keys = _checkpoint_keys(files)
    # LoRA: the wrapped linears' weights are read under the base model's names (``.base_layer``
    # dropped); the adapters are in no base checkpoint.
    state_dict = {k: v for k, v in get_model_state_dict(model).items()
                  if not is_adapter_param(k) and k not in skip}
    name = {k: checkpoint_key(k) for k in state_dict}
    param_id = {checkpoint_key(n): id(p) for n, p in model.named_parameters(remove_duplicate=False)}
    in_ckpt = {param_id[k] for k in ckpt_keys if k in param_id}  # tied aliases count as present
    to_read = {name[k]: t for k, t in state_dict.items() if name[k] in ckpt_keys}
    missing = [k for k in state_dict if name[k] not in ckpt_keys and param_id.get(name[k]) not in in_ckpt]
    if missing:
        raise ValueError(
            f"{len(missing)} model tensor(s) are not in the checkpoint {str(path)!r}, e.g. "
            f"{missing[:5]}; its keys look like {sorted(ckpt_keys)[:3]} (a checkpoint of another "
            "architecture or with renamed keys?)"
        )
    dcp.load(to_read, storage_reader=SliceReader(str(path)))
    # DCP wrote into the state-dict tensors, which are the parameters' own storage for FSDP2/TP
    # DTensors and plain tensors; setting them back is a no-op copy that also covers wrappers
    # whose state dict is a copy.
    loaded = {k: to_read[name[k]] for k in state_dict if name[k] in to_read}
    set_model_state_dict(model, loaded, options=StateDictOptions(strict=False))


def _checkpoint_keys(files: list[Path]) -> set[str]:
    """Tensor names in the safetensors headers (the data is not read)."""
    return {name for f in files for name in read_header(f)}


# ------------------------------------------------------------------------- slice reads by pread
_TEMP_BYTES = 64 * 2**20
"""Largest temporary buffer of a strided or dtype-converting read (whole rows are read in blocks)."""


def _readinto(f, pos: int, out: torch.Tensor) -> None:
    """Read ``out.nbytes`` bytes at ``pos`` into the contiguous CPU tensor ``out``."""
    view = memoryview(out.view(-1).view(torch.uint8).numpy())
    f.seek(pos)
    got = 0
    while got < len(view):
        n = f.readinto(view[got:])
        if not n:
            raise EOFError(f"{f.name}: truncated safetensors file")
        got += n


# The dtype names of the safetensors format (its spec), mapped to torch dtypes.
SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}


def read_slice(f, data_start: int, info: dict, offsets, lengths, target: torch.Tensor) -> None:
    """Copy ``stored[offsets : offsets + lengths]`` of the stored tensor described by ``info`` into
    ``target``. A slice whose trailing dims are whole is one contiguous byte range, read directly
    into ``target`` when dtype, device and layout allow; otherwise whole rows are read in blocks of
    at most ``_TEMP_BYTES`` and the slice copied out of them."""
    dtype, shape = SAFETENSORS_DTYPES[info["dtype"]], list(info["shape"])
    base = data_start + info["data_offsets"][0]
    if not shape:  # a scalar
        tmp = torch.empty((), dtype=dtype)
        _readinto(f, base, tmp)
        target.copy_(tmp)
        return
    row_elems = math.prod(shape[1:])
    row_bytes = row_elems * dtype.itemsize
    contiguous_rows = all(o == 0 and n == s for o, n, s in zip(offsets[1:], lengths[1:], shape[1:]))
    if (contiguous_rows and target.dtype == dtype and target.device.type == "cpu"
            and target.is_contiguous()):
        _readinto(f, base + offsets[0] * row_bytes, target)
        return
    inner = tuple(slice(o, o + n) for o, n in zip(offsets[1:], lengths[1:]))
    rows_per_block = max(1, _TEMP_BYTES // max(1, row_bytes))
    for start in range(0, lengths[0], rows_per_block):
        rows = min(rows_per_block, lengths[0] - start)
        tmp = torch.empty([rows, *shape[1:]], dtype=dtype)
        _readinto(f, base + (offsets[0] + start) * row_bytes, tmp)
        target[start:start + rows].copy_(tmp[(slice(None), *inner)])


class SliceReader(HuggingFaceStorageReader):
    """``HuggingFaceStorageReader`` (same metadata, same DCP planning) whose reads ``pread`` each
    requested slice into its destination instead of slicing an mmap (see the module doc)."""

    def read_data(self, plan, planner):
        per_file: dict[str, list] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        for file, items in per_file.items():
            header, data_start = read_header(file, with_data_start=True)
            with open(file, "rb", buffering=0) as f:
                for item in items:
                    target = planner.resolve_tensor(item).detach()
                    read_slice(f, data_start, header[item.storage_index.fqn],
                               list(item.storage_offsets), list(item.lengths), target)
                    planner.commit_tensor(item, target)
        fut: Future = Future()
        fut.set_result(None)
        return fut
