"""Safe storage helpers for checkpoints: no pickle is ever loaded from a checkpoint.

* ``split_tensors`` / ``join_tensors``: any nest of dicts, lists, tuples, scalars and tensors is
  split into a flat ``{key: tensor}`` dict (saved with DCP) and a JSON skeleton that names them.
* ``SafeFileSystemReader``: DCP's reader, except that ``.metadata`` (a pickle written by DCP) is read
  with an allow-list unpickler that only builds DCP's own metadata classes, and byte (pickled)
  entries are refused. Tensor data is read by DCP with ``torch.load(weights_only=True)``.
* ``write_json_atomic``: tmp file + fsync + ``os.replace``: a reader sees the old file or the new one.
* RNG states (python, numpy, torch CPU, CUDA) as JSON.
"""

from __future__ import annotations

import base64
import io
import json
import os
import pickle
import random
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata

_TENSOR, _TUPLE, _DICT = "__tensor__", "__tuple__", "__dict__"


# ------------------------------------------------------------------ tensors <-> JSON skeleton
def split_tensors(obj: Any, prefix: str, tensors: dict[str, torch.Tensor]) -> Any:
    """Move every tensor leaf of ``obj`` into ``tensors`` (key = its path under ``prefix``) and
    return a JSON-able skeleton. Raises ``TypeError`` for a leaf that is neither (no pickling)."""
    if isinstance(obj, torch.Tensor):
        if prefix in tensors:
            raise ValueError(f"two checkpoint entries map to the key {prefix!r}")
        tensors[prefix] = obj
        return {_TENSOR: prefix}
    if isinstance(obj, dict):
        plain = all(isinstance(k, str) and not k.startswith("__") for k in obj)
        if plain:
            return {k: split_tensors(v, f"{prefix}/{k}", tensors) for k, v in obj.items()}
        for k in obj:
            if not (k is None or isinstance(k, (str, int, float, bool))):
                raise TypeError(f"cannot store dict key {k!r} ({type(k).__name__}) at {prefix!r}")
        return {_DICT: [[k, split_tensors(v, f"{prefix}/{k}", tensors)] for k, v in obj.items()]}
    if isinstance(obj, tuple):
        return {_TUPLE: [split_tensors(v, f"{prefix}/{i}", tensors) for i, v in enumerate(obj)]}
    if isinstance(obj, list):
        return [split_tensors(v, f"{prefix}/{i}", tensors) for i, v in enumerate(obj)]
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise TypeError(
        f"cannot store a {type(obj).__name__} at {prefix!r} in a checkpoint: only tensors, dicts, "
        "lists, tuples, str, int, float, bool and None are stored (never pickled objects)"
    )


def tensor_keys(skeleton: Any) -> list[str]:
    """The tensor keys a skeleton refers to, in order."""
    out: list[str] = []

    def walk(node):
        if isinstance(node, dict):
            if _TENSOR in node and len(node) == 1:
                out.append(node[_TENSOR])
            elif _DICT in node and len(node) == 1:
                for _, v in node[_DICT]:
                    walk(v)
            elif _TUPLE in node and len(node) == 1:
                for v in node[_TUPLE]:
                    walk(v)
            else:
                for v in node.values():
                    walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk(skeleton)
    return out


def join_tensors(skeleton: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """Inverse of ``split_tensors``."""
    if isinstance(skeleton, dict):
        if len(skeleton) == 1 and _TENSOR in skeleton:
            return tensors[skeleton[_TENSOR]]
        if len(skeleton) == 1 and _TUPLE in skeleton:
            return tuple(join_tensors(v, tensors) for v in skeleton[_TUPLE])
        if len(skeleton) == 1 and _DICT in skeleton:
            return {k: join_tensors(v, tensors) for k, v in skeleton[_DICT]}
        return {k: join_tensors(v, tensors) for k, v in skeleton.items()}
    if isinstance(skeleton, list):
        return [join_tensors(v, tensors) for v in skeleton]
    return skeleton


# ------------------------------------------------------------------------- safe DCP reading
_ALLOWED_GLOBALS = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata",
        "TensorStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "MetadataIndex",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath", "Path"},
    "collections": {"OrderedDict"},
}


class _MetadataUnpickler(pickle.Unpickler):
    """Builds DCP metadata only: any other global (``os.system``...) is refused."""

    def find_class(self, module: str, name: str):
        if name in _ALLOWED_GLOBALS.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(
            f"checkpoint metadata refers to {module}.{name}, which is not a DCP metadata type: "
            "refusing to load it (the checkpoint may be corrupted or tampered with)"
        )


def read_dcp_metadata(path: str | os.PathLike) -> Metadata:
    """Read a DCP ``.metadata`` file with the allow-list unpickler."""
    with open(Path(path) / ".metadata", "rb") as f:
        metadata = _MetadataUnpickler(io.BytesIO(f.read())).load()
    if not isinstance(metadata, Metadata):
        raise pickle.UnpicklingError(f"{path}/.metadata does not hold DCP metadata")
    return metadata


class SafeFileSystemReader(FileSystemReader):
    """``FileSystemReader`` that never unpickles arbitrary objects (see module docstring)."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        from torch.distributed.checkpoint.metadata import StorageMeta

        metadata = read_dcp_metadata(self.path)
        for key, md in metadata.state_dict_metadata.items():
            if isinstance(md, BytesStorageMetadata):
                raise ValueError(
                    f"checkpoint {self.path} holds a pickled entry {key!r}; ndparallel checkpoints "
                    "hold tensors only, refusing to unpickle it"
                )
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


# ------------------------------------------------------------------------------- JSON files
def write_json_atomic(path: str | os.PathLike, obj: Any) -> None:
    """Write JSON so that a crash leaves either the old file or the complete new one."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, sort_keys=False, allow_nan=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def fsync_dir(path: str | os.PathLike) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def read_json(path: str | os.PathLike) -> Any:
    with open(path) as f:
        return json.load(f)


# ------------------------------------------------------------------------------- RNG states
def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.cpu().numpy().tobytes()).decode("ascii")


def _unb64(s: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8).clone()


def rng_state() -> dict[str, Any]:
    """This process's RNG states as JSON-able data."""
    version, state, gauss = random.getstate()
    out: dict[str, Any] = {"python": [version, list(state), gauss], "torch": _b64(torch.get_rng_state())}
    try:
        import numpy as np

        name, keys, pos, has_gauss, cached = np.random.get_state()
        out["numpy"] = [name, keys.tolist(), int(pos), int(has_gauss), float(cached)]
    except ImportError:
        pass
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = [_b64(s) for s in torch.cuda.get_rng_state_all()]
    return out


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what ``rng_state`` returned."""
    version, keys, gauss = state["python"]
    random.setstate((version, tuple(keys), gauss))
    torch.set_rng_state(_unb64(state["torch"]))
    if "numpy" in state:
        try:
            import numpy as np

            name, keys, pos, has_gauss, cached = state["numpy"]
            np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
        except ImportError:
            pass
    if "cuda" in state and torch.cuda.is_available():
        cuda = [_unb64(s) for s in state["cuda"]]
        if len(cuda) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(cuda)
