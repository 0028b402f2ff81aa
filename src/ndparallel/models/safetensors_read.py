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

import dataclasses
import math
from pathlib import Path

import torch
import torch.nn as nn
from torch.distributed.checkpoint import HuggingFaceStorageReader
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.futures import Future

from ndparallel.models.adapters import checkpoint_key, is_adapter_param
from ndparallel.models.key_conversion import CheckpointKeys, checkpoint_keys
from ndparallel.models.weights import read_header


def load_sharded_safetensors(
    model: nn.Module,
    path: Path,
    files: list[Path],
    skip: set[str] = frozenset(),
    plan: CheckpointKeys | None = None,
) -> None:
    """Fill every parameter and persistent buffer of ``model`` (plain tensors or DTensor shards)
    from the safetensors files in ``path``, reading only this rank's slices (DCP resharding).

    Collective: every rank of the default group must call it. Keys are matched as transformers
    does (``key_conversion``: renamed and fused tensors, e.g. GPT-NeoX's ``embed_out``, MoE experts
    stored one per expert). Tied parameters are read once, under the key the checkpoint holds
    (``save_pretrained`` omits ``lm_head.weight`` when tied; a pipeline stage's own copy of it is read
    from the embedding's key). ``skip``: names left for the caller
    (grown token rows). ``plan``: the key matching, if already made (``checkpoint_plan``, on the
    model before it was parallelised)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        set_model_state_dict,
    )

    stored = stored_tensors(files)
    plan = plan or checkpoint_keys(model, {k: (v[0], v[1]) for k, v in stored.items()})
    # LoRA: the wrapped linears' weights are read under the base model's names (``.base_layer``
    # dropped); the adapters are in no base checkpoint.
    state_dict = {
        k: v for k, v in get_model_state_dict(model).items() if not is_adapter_param(k) and k not in skip
    }
    name = {k: checkpoint_key(k) for k in state_dict}
    param_id = {checkpoint_key(n): id(p) for n, p in model.named_parameters(remove_duplicate=False)}
    apart = _tied_apart(model, param_id, plan, stored)
    if apart:
        plan = dataclasses.replace(plan, direct={**plan.direct, **apart})
    in_ckpt = {param_id[k] for k in param_id if plan.has(k)}  # tied aliases count as present
    to_read = {name[k]: t for k, t in state_dict.items() if plan.has(name[k])}
    missing = [k for k in state_dict if not plan.has(name[k]) and param_id.get(name[k]) not in in_ckpt]
    if missing:
        raise ValueError(
            f"{len(missing)} model tensor(s) are not in the checkpoint {str(path)!r}, e.g. "
            f"{missing[:5]}; its keys look like {sorted(stored)[:3]} (a checkpoint of another "
            "architecture or with renamed keys?)"
        )
    if plan.converted():  # save_pretrained writes the checkpoint's layout back (transformers' way)
        model._weight_conversions = plan.transforms
    dcp.load(to_read, storage_reader=SliceReader(str(path), model, plan, stored))
    # DCP wrote into the state-dict tensors, which are the parameters' own storage for FSDP2/TP
    # DTensors and plain tensors; setting them back is a no-op copy that also covers wrappers
    # whose state dict is a copy.
    loaded = {k: to_read[name[k]] for k in state_dict if name[k] in to_read}
    set_model_state_dict(model, loaded, options=StateDictOptions(strict=False))


def _tied_apart(
    model: nn.Module, param_id: dict[str, int], plan: CheckpointKeys, stored: dict
) -> dict[str, str]:
    """Model key -> stored key of each tied weight that ``model`` holds apart from its source (a
    pipeline's last stage holds the LM head of tied embeddings, a copy or alone): read from the
    source's key, which is all ``save_pretrained`` stored (transformers ties them on load)."""
    if not getattr(getattr(model, "config", None), "tie_word_embeddings", False):
        return {}
    out = {}
    for target, source in (getattr(model, "_tied_weights_keys", None) or {}).items():
        key = plan.direct.get(source, source if source in stored else None)
        if target in param_id and not plan.has(target) and key and param_id.get(source) != param_id[target]:
            out[target] = key
    return out


def checkpoint_plan(model: nn.Module, files: list[Path]) -> CheckpointKeys:
    """How ``files`` fill ``model`` (``key_conversion.checkpoint_keys`` over the headers)."""
    return checkpoint_keys(model, {k: (v[0], v[1]) for k, v in stored_tensors(files).items()})


def stored_tensors(files: list[Path]) -> dict[str, tuple[str, list[int], Path]]:
    """Tensor name -> (safetensors dtype, shape, file) from the headers (the data is not read)."""
    return {
        name: (info["dtype"], list(info["shape"]), f) for f in files for name, info in read_header(f).items()
    }


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
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
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
    if contiguous_rows and target.dtype == dtype and target.device.type == "cpu" and target.is_contiguous():
        _readinto(f, base + offsets[0] * row_bytes, target)
        return
    inner = tuple(slice(o, o + n) for o, n in zip(offsets[1:], lengths[1:]))
    rows_per_block = max(1, _TEMP_BYTES // max(1, row_bytes))
    for start in range(0, lengths[0], rows_per_block):
        rows = min(rows_per_block, lengths[0] - start)
        tmp = torch.empty([rows, *shape[1:]], dtype=dtype)
        _readinto(f, base + (offsets[0] + start) * row_bytes, tmp)
        target[start : start + rows].copy_(tmp[(slice(None), *inner)])


class SliceReader(HuggingFaceStorageReader):
    """A DCP storage reader over a model directory's safetensors files whose metadata is the
    model's keys (``key_conversion.checkpoint_keys``: stored tensors renamed or fused as
    transformers does) and whose reads ``pread`` each requested slice into its destination
    instead of slicing an mmap (see the module doc); a fused tensor's slice is built by its
    transformers converter from the stored tensors it needs."""

    def __init__(self, path: str, model: nn.Module, plan: CheckpointKeys, stored: dict):
        super().__init__(path)
        self._model, self._plan, self._stored = model, plan, stored
        self._headers: dict = {}

    def _header(self, file):
        if file not in self._headers:
            self._headers[file] = read_header(file, with_data_start=True)
        return self._headers[file]

    def read_metadata(self) -> Metadata:
        entries = {}
        for key, stored_key in self._plan.direct.items():
            dtype, shape, _ = self._stored[stored_key]
            entries[key] = (SAFETENSORS_DTYPES[dtype], shape)
        for key, group in self._plan.fused.items():
            entries[key] = (group.dtypes[key], list(group.shapes[key]))
        metadata = Metadata(
            state_dict_metadata={
                key: TensorStorageMetadata(
                    properties=TensorProperties(dtype=dtype),
                    size=torch.Size(shape),
                    chunks=[
                        ChunkStorageMetadata(offsets=torch.Size([0] * len(shape)), sizes=torch.Size(shape))
                    ],
                )
                for key, (dtype, shape) in entries.items()
            },
            storage_data={MetadataIndex(key, [0] * len(shape)): key for key, (_, shape) in entries.items()},
        )
        metadata.storage_meta = StorageMeta(load_id=self.load_id)
        return metadata

    def read_data(self, plan, planner):
        direct, fused = {}, []
        for item in plan.items:
            fqn = item.storage_index.fqn
            if fqn in self._plan.direct:
                stored_key = self._plan.direct[fqn]
                direct.setdefault(self._stored[stored_key][2], []).append((item, stored_key))
            else:
                fused.append(item)
        for file, items in direct.items():
            header, data_start = self._header(file)
            with open(file, "rb", buffering=0) as f:
                for item, stored_key in items:
                    target = planner.resolve_tensor(item).detach()
                    read_slice(
                        f,
                        data_start,
                        header[stored_key],
                        list(item.storage_offsets),
                        list(item.lengths),
                        target,
                    )
                    planner.commit_tensor(item, target)
        for item in fused:
            fqn = item.storage_index.fqn
            target = planner.resolve_tensor(item).detach()
            piece = self._plan.fused[fqn].read(
                self._model,
                fqn,
                list(item.storage_offsets),
                list(item.lengths),
                self._read_whole,
                self._read_rows,
                out=target if target.is_contiguous() else None,
            )
            if piece is not target:
                target.copy_(piece)
            planner.commit_tensor(item, target)
        fut: Future = Future()
        fut.set_result(None)
        return fut

    def _read_whole(self, key: str) -> torch.Tensor:
        return self._read_rows(key, 0, self._stored[key][1][0] if self._stored[key][1] else 0)

    def _read_rows(self, key: str, lo: int, hi: int) -> torch.Tensor:
        """Rows ``[lo, hi)`` of a stored tensor (all of a scalar)."""
        dtype, shape, file = self._stored[key]
        header, data_start = self._header(file)
        part = [hi - lo, *shape[1:]] if shape else []
        out = torch.empty(part, dtype=SAFETENSORS_DTYPES[dtype])
        with open(file, "rb", buffering=0) as f:
            read_slice(f, data_start, header[key], [lo] + [0] * (len(shape) - 1) if shape else [], part, out)
        return out
