"""The layout part of an Axolotl config translated (``translate``): FSDP1's ``fsdp:`` list,
``fsdp_version: 1``, ``fsdp_config`` with its legacy ``fsdp_`` prefixes and FSDP1 knobs, DeepSpeed
ZeRO configs, and the default without degrees (data parallel over every local device)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ndparallel.axolotl.keys import FSDP, Translation, is_empty, short

DEGREES = (
    "dp_replicate_size",
    "dp_shard_size",
    "tensor_parallel_size",
    "context_parallel_size",
    "tp_size",
    "cp_size",
    "pipeline_parallel_size",
    "pp_size",
)


def _no_degrees(t: Translation) -> bool:
    return not any(t.data.get(k) not in (None, 1) for k in DEGREES)


def _shard_everything(t: Translation, why: str) -> None:
    """Axolotl's FSDP / ZeRO over every GPU: dp_shard_size -1 when no degree is given (said once)."""
    if _no_degrees(t):
        t.data["dp_shard_size"] = -1
        t.notes.append(why + " -> FSDP2 over every rank (dp_shard_size: -1)")
    elif t.data.get("dp_shard_size") != -1:
        t.notes.append(why + " -> FSDP2 over the given degrees")


def default_layout(t: Translation) -> None:
    """No degree given: Axolotl's launch — data parallel over every local GPU (sharded when the config
    asks for FSDP); on CPU, over ``--nproc-per-node`` ranks."""
    if not _no_degrees(t) or any(k in t.data for k in DEGREES):
        return
    experts = any(
        isinstance(t.data.get(k), int) and t.data[k] > 1 for k in ("expert_parallel_size", "ep_size")
    )
    fsdp = bool(t.data.get("fsdp_config")) or t.data.get("fsdp_version") is not None or experts
    key = "dp_shard_size" if fsdp else "dp_replicate_size"
    t.data[key] = -1
    t.notes.append(
        f"no parallelism degree given: {'FSDP2' if fsdp else 'data parallel'} over every local device "
        f"({key}: -1: every GPU; on CPU --nproc-per-node N ranks, default 1)"
        + ("; expert_parallel_size borrows its ranks from those FSDP ranks" if experts else "")
    )


def fsdp_list(t: Translation, key: str, value: Any) -> None:
    if is_empty(value):
        return
    words = value.split() if isinstance(value, str) else [str(v) for v in value]
    fsdp = t.data.setdefault("fsdp_config", {}) or {}
    t.data["fsdp_config"] = fsdp
    unknown = [
        w
        for w in words
        if w not in ("full_shard", "shard_grad_op", "hybrid_shard", "no_shard", "offload", "auto_wrap")
    ]
    if unknown or "hybrid_shard" in words:
        t.refuse(
            key,
            value,
            "use full_shard, shard_grad_op, offload, auto_wrap (hybrid sharding: set "
            "dp_replicate_size = nodes and dp_shard_size = GPUs per node)",
        )
        return
    if "shard_grad_op" in words:
        fsdp.setdefault("reshard_after_forward", False)
    if "offload" in words:
        fsdp.setdefault("offload_params", True)
    if "no_shard" not in words:
        _shard_everything(t, f"fsdp: {short(value)}")


def fsdp_version(t: Translation, key: str, value: Any) -> None:
    if value in (1, "1"):
        t.data[key] = 2
        t.notes.append(
            "fsdp_version: 1 -> FSDP2 (per-parameter sharding of the same model: the same training)"
        )


def deepspeed(t: Translation, key: str, value: Any) -> None:
    if is_empty(value):
        return
    stage, offload = _zero_settings(value)
    if stage is None:
        t.refuse(
            key,
            value,
            "not a readable DeepSpeed ZeRO config (a JSON file with zero_optimization.stage, "
            "or Axolotl's deepspeed_configs/zero{1,2,3}*.json): remove it and use fsdp_config",
        )
        return
    fsdp = t.data.setdefault("fsdp_config", {}) or {}
    t.data["fsdp_config"] = fsdp
    fsdp.setdefault("reshard_after_forward", stage == 3)
    if offload:
        fsdp.setdefault("offload_params", True)
    _shard_everything(t, f"deepspeed: ZeRO-{stage}{' + CPU offload' if offload else ''}")


def _zero_settings(value: Any) -> tuple[int | None, bool]:
    """(ZeRO stage, parameters offloaded) of a DeepSpeed config: a dict, a JSON file, or the name of
    one of the configs Axolotl ships (``deepspeed_configs/zero3_bf16_cpuoffload_all.json``)."""
    if isinstance(value, str):
        path = Path(value).expanduser()
        if path.is_file():
            try:
                value = json.loads(path.read_text())
            except (OSError, ValueError):
                return None, False
        else:
            name = path.name
            for stage in (1, 2, 3):
                if name.startswith(f"zero{stage}") and name.endswith(".json"):
                    return stage, "cpuoffload" in name and "params" in name or name.endswith(
                        "cpuoffload_all.json"
                    )
            return None, False
    zero = value.get("zero_optimization", {}) if isinstance(value, dict) else {}
    stage = zero.get("stage")
    offload = (zero.get("offload_param") or {}).get("device") in ("cpu", "nvme")
    return (int(stage) if stage in (0, 1, 2, 3, "0", "1", "2", "3") else None), offload


def fsdp_config(t: Translation) -> None:
    fsdp = t.data.get("fsdp_config")
    if not isinstance(fsdp, dict):
        return
    renamed = [k for k in fsdp if k.startswith("fsdp_")]
    out = {k.removeprefix("fsdp_") if k != "fsdp_version" else "version": v for k, v in fsdp.items()}
    if renamed:
        t.notes.append(
            f"fsdp_config: Axolotl's legacy fsdp_ prefix dropped ({', '.join(renamed[:3])}"
            f"{', ...' if len(renamed) > 3 else ''})"
        )
    for old, new in (("offload_params", "cpu_offload"), ("transformer_layer_cls_to_wrap", "layer_classes")):
        if old in out:
            t.rename_in(out, "fsdp_config", old, new)
    ignored = []
    for key in list(out):
        rule = FSDP.get(key)
        if rule is None:
            continue
        value = out.pop(key)
        if key == "version":
            if not is_empty(value) and value not in (2, "2") and t.data.get("fsdp_version") in (None, 1, "1"):
                t.notes.append("fsdp_config.fsdp_version: 1 -> FSDP2 (the same training)")
            elif not is_empty(value) and t.data.get("fsdp_version") not in (None, value):
                t.problems.append(
                    f"fsdp_config.fsdp_version: {value} and fsdp_version: {t.data['fsdp_version']} "
                    "disagree; keep one"
                )
        elif key == "sharding_strategy":
            _sharding_strategy(t, out, value)
        elif not is_empty(value, rule.default):
            ignored.append(key)
    if ignored:
        t.notes.append(f"fsdp_config: {', '.join(ignored)}: {FSDP[ignored[0]].text}")
    t.data["fsdp_config"] = out


def _sharding_strategy(t: Translation, fsdp: dict, value: Any) -> None:
    name = str(value).upper().split(".")[-1]
    if name in ("FULL_SHARD", "1"):
        fsdp.setdefault("reshard_after_forward", True)
    elif name in ("SHARD_GRAD_OP", "2"):
        fsdp.setdefault("reshard_after_forward", False)
    elif name in ("NO_SHARD", "3"):
        return
    else:
        t.refuse(
            "fsdp_config.sharding_strategy",
            value,
            "hybrid sharding: set dp_replicate_size = nodes and "
            "dp_shard_size = GPUs per node; else FULL_SHARD, SHARD_GRAD_OP or NO_SHARD",
        )
        return
    _shard_everything(t, f"fsdp_config.sharding_strategy: {name}")
