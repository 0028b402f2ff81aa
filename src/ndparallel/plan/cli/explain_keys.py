"""``--explain LAYOUT``: its keys are the training config's (``dp_shard_size=4``,
``tensor_parallel_size=8``, ``micro_batch_size=2``, ``pipeline_schedule=1F1B``), or the compact
``2x4x1x8`` (dp_replicate x dp_shard x cp x tp; ``pp16:`` before it, ``+ep8`` after it); the older
short keys (``tp=``, ``mb=``, ``ac=``) are read with a note. ``layout_text`` writes a layout and
its pins back in the same keys."""

from __future__ import annotations

import re
import sys

from ndparallel.layout.dims import MESH_DIM_NAMES, ParallelDims
from ndparallel.plan.pipeline.schedule_model import canonical

DEGREES = {
    "pipeline_parallel_size": "pp",
    "dp_replicate_size": "dp_replicate",
    "dp_shard_size": "dp_shard",
    "context_parallel_size": "cp",
    "tensor_parallel_size": "tp",
    "expert_parallel_size": "ep",
}
"""The training config's degree keys -> the ``ParallelDims`` field."""
ALIASES = {"pp_size": "pp", "cp_size": "cp", "tp_size": "tp", "ep_size": "ep"}
"""The training config's shorter spellings of the same keys (its ``validation_alias``)."""
OLD_DEGREES = {
    **{k: "pp" for k in ("pp",)},
    **{k: "dp_replicate" for k in ("dp_replicate", "dr", "r", "replicate", "ddp")},
    **{k: "dp_shard" for k in ("dp_shard", "ds", "s", "fsdp", "shard")},
    **{k: "cp" for k in ("cp", "c")},
    **{k: "tp" for k in ("tp", "t")},
    **{k: "ep" for k in ("ep", "e")},
}
"""Today's short degree keys, read with a note for one release."""


def on_off(key: str, text: str) -> bool:
    """A pinned switch: on / off (true / false, 1 / 0)."""
    if text.lower() not in ("on", "off", "true", "false", "1", "0"):
        raise ValueError(f"{key}={text!r}: use on or off")
    return text.lower() in ("on", "true", "1")


def policy(text: str) -> str:
    """A pinned ``ac_policy``: full, selective or op."""
    if text.lower() not in ("full", "selective", "op"):
        raise ValueError(f"ac_policy={text!r}: use full, selective or op")
    return text.lower()


PINS = {
    "micro_batch_size": lambda key, text: int(text),
    "activation_checkpointing": on_off,
    "pipeline_schedule": lambda key, text: canonical(text),
    "pipeline_virtual_stages": lambda key, text: int(text),
    "unsharded_grad_accumulation": on_off,
    "ac_policy": lambda key, text: policy(text),
    "activation_offloading": on_off,
    "reshard_after_forward": on_off,
    "tiled_mlp": on_off,
}
"""The searched settings ``--explain`` pins (``search/request.py``'s ``SEARCHED``), by key, and the
reader of each value."""
OLD_PINS = {
    "mb": "micro_batch_size",
    "ac": "activation_checkpointing",
    "schedule": "pipeline_schedule",
    "sched": "pipeline_schedule",
    "v": "pipeline_virtual_stages",
    "virtual": "pipeline_virtual_stages",
    "uga": "unsharded_grad_accumulation",
}
"""Today's short pin keys, read with a note for one release."""
KEY_OF = {dim: key for key, dim in DEGREES.items()}


def parse_layout(text: str) -> tuple[ParallelDims, dict]:
    """(the layout, the pinned settings by ``Settings`` name) of ``--explain``'s ``text``: keys as in
    the module doc, separated by commas or spaces; a degree not given is 1."""
    text = text.strip()
    values: dict = {}
    pins: dict = {}
    for part in filter(None, re.split(r"[,\s]+", text)):
        compact = re.fullmatch(r"(?:pp(\d+):)?(\d+x\d+x\d+x\d+)(?:\+ep(\d+))?", part)
        if compact and not values:
            values = dict(zip(MESH_DIM_NAMES, (int(v) for v in compact.group(2).split("x"))))
            values.update({k: int(compact.group(i)) for k, i in (("pp", 1), ("ep", 3)) if compact.group(i)})
            continue
        if "=" not in part:
            raise ValueError(f"cannot read {part!r} in layout {text!r}: use key=value or AxBxCxD")
        key, val = (s.strip() for s in part.split("=", 1))
        name = key.lower()
        if name in OLD_DEGREES or name in OLD_PINS:
            new = KEY_OF[OLD_DEGREES[name]] if name in OLD_DEGREES else OLD_PINS[name]
            print(f"ndparallel plan: note: --explain key {key!r} is deprecated: use {new}=", file=sys.stderr)
            name = new
        if name in DEGREES or name in ALIASES:
            values[DEGREES.get(name) or ALIASES[name]] = int(val)
        elif name in PINS:
            pins[name] = PINS[name](key, val)
        else:
            raise ValueError(
                f"unknown layout key {key!r} (use the training config's {', '.join(DEGREES)}, "
                f"and {', '.join(PINS)})"
            )
    if not values:
        raise ValueError(f"layout {text!r} names no degree")
    return ParallelDims(**values), pins  # ParallelDims refuses an ep that does not divide dp_shard·cp·tp


def layout_text(layout: ParallelDims, **pins) -> str:
    """``layout`` (and ``pins``, by key) as ``--explain`` reads it: the training config's keys, the
    pipeline and expert degrees only where more than 1."""
    shown = {"pp": layout.pp_enabled, "ep": layout.ep_enabled}
    degrees = [f"{k}={getattr(layout, dim)}" for k, dim in DEGREES.items() if shown.get(dim, True)]
    return ",".join(degrees + [f"{k}={v}" for k, v in pins.items()])
