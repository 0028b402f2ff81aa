"""Read a QLoRA base from safetensors into NF4 shards, quantising each rank's rows as they arrive.

``load_model`` builds the model on the meta device with NF4 linear weights (``quantized``), lets the
strategies shard it there (FSDP2 splits an ``NF4Tensor``'s packed bytes along dim 0, torchao's
mechanism), materialises it, and then calls ``load_nf4_weights``: one decoder layer at a time, a
high-precision DTensor shaped like each NF4 weight's shard receives this rank's rows from the files
(DCP slice reads, ``safetensors_read.SliceReader``), ``quantize_row_shard`` turns them into the NF4
shard that ``to_nf4(full weight)`` would give, and the shard replaces the placeholder
(``swap_tensors``: the Parameter object FSDP2 holds is kept; FSDP2 re-reads its shard at its lazy
init, as after ``load_state_dict(assign=True)``).

Host/device memory while loading: the NF4 shards (model/N at ~0.52 byte/param) + one decoder
layer's shard of the quantised linears in the load dtype + that layer's block absmaxes all-gathered
(1/64 of the layer's values). Never a whole weight, let alone the whole model, in high precision
on a rank (Llama-3.1-70B, bf16, FSDP 8: 0.86B params/layer → 0.21 GB per rank at a time).
I/O: each rank reads only its rows (model/N per rank, like the unquantised load).
"""

from __future__ import annotations

import re
from collections import defaultdict
from pathlib import Path

import torch
import torch.nn as nn

from ndparallel.models.adapters import checkpoint_key
from ndparallel.models.key_conversion import checkpoint_keys
from ndparallel.models.quantized import NF4Config, is_nf4, quantize_row_shard
from ndparallel.models.safetensors_read import SliceReader, stored_tensors

_LAYER = re.compile(r"^(.*?\.layers\.\d+)\.")


def _row_group(param: torch.Tensor):
    """The process group ``param``'s dim 0 is sharded over (None: not sharded)."""
    from torch.distributed.tensor import Shard

    if not hasattr(param, "device_mesh"):
        return None
    dims = [i for i, p in enumerate(param.placements) if isinstance(p, Shard)]
    if any(param.placements[i].dim != 0 for i in dims) or len(dims) > 1:
        raise ValueError(
            f"an NF4 weight sharded as {param.placements}: only FSDP's dim-0 sharding is "
            "supported (no tensor parallel with a 4-bit base)"
        )
    if not dims or param.device_mesh.size(dims[0]) == 1:
        return None
    return param.device_mesh.get_group(dims[0])


def _high_precision_like(param: torch.Tensor, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An empty tensor (a DTensor with ``param``'s layout when it is one) in ``dtype``."""
    if not hasattr(param, "device_mesh"):
        return torch.empty(param.shape, dtype=dtype, device=device)
    from torch.distributed.tensor import DTensor

    local = torch.empty(param.to_local().shape, dtype=dtype, device=device)
    return DTensor.from_local(
        local, param.device_mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride()
    )


def _device_of(param: torch.Tensor) -> torch.device:
    return param.to_local().device if hasattr(param, "device_mesh") else param.device


def _swap_in(param: nn.Parameter, nf4_local: torch.Tensor) -> None:
    if hasattr(param, "device_mesh"):
        from torch.distributed.tensor import DTensor

        new = DTensor.from_local(
            nf4_local,
            param.device_mesh,
            param.placements,
            run_check=False,
            shape=param.shape,
            stride=param.stride(),
        )
    else:
        new = nf4_local
    torch.utils.swap_tensors(param, nn.Parameter(new, requires_grad=False))


def nf4_layer_groups(names: list[str]) -> list[list[str]]:
    """Parameter names grouped by decoder layer (``...layers.N.``), in order; others last."""
    groups: dict[str, list[str]] = defaultdict(list)
    for n in names:
        m = _LAYER.match(n)
        groups[m.group(1) if m else ""].append(n)
    return [groups[k] for k in sorted(groups, key=lambda k: (k == "", k))]


def _config_of(param: torch.Tensor) -> NF4Config:
    local = getattr(param, "_local_tensor", param)
    return NF4Config(local.block_size, local.scaler_block_size)


def load_nf4_weights(
    model: nn.Module, path: Path, files: list[Path], device: torch.device | None = None
) -> None:
    """Fill every NF4 parameter (placeholder) of the materialised ``model`` from the safetensors
    ``files``, one decoder layer at a time (see the module doc), with the placeholders' block sizes,
    reading and quantising in their dtype (the load dtype) on ``device`` (default: where each shard
    lives). Collective."""
    import torch.distributed.checkpoint as dcp

    params = dict(model.named_parameters())
    names = [n for n, p in params.items() if is_nf4(p)]
    stored = stored_tensors(files)
    plan = checkpoint_keys(model, {k: (v[0], v[1]) for k, v in stored.items()})  # transformers' key matching
    missing = [checkpoint_key(n) for n in names if not plan.has(checkpoint_key(n))]
    if missing:
        raise ValueError(
            f"{len(missing)} weight(s) are not in the checkpoint {str(path)!r}, e.g. {missing[:5]}"
        )
    for group in nf4_layer_groups(names):
        rows = {
            checkpoint_key(n): _high_precision_like(
                params[n], params[n].dtype, device or _device_of(params[n])
            )
            for n in group
        }
        dcp.load(rows, storage_reader=SliceReader(str(path), model, plan, stored))
        for n in group:
            p, read = params[n], rows.pop(checkpoint_key(n))
            local = read.to_local() if hasattr(read, "device_mesh") else read
            nf4 = quantize_row_shard(local, _config_of(p), _row_group(p))
            _swap_in(p, nf4.to(_device_of(p)))
