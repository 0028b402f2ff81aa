"""The ``ndparallel plan`` command line's options, one group per concern (``cli.py`` runs them), and
the ``--explain LAYOUT`` text. The flags of the run's ``Settings`` and of the search's choices in
``PlanRequest`` come from their fields' metadata (``plan/field_marks.py``'s ``flag``): ``field_flags``."""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass, fields

from ndparallel.layout.dims import MESH_DIM_NAMES, ParallelDims
from ndparallel.plan import hardware as hwmod
from ndparallel.plan.field_marks import ADAPTERS, BATCH, GROUPS, LONG_CONTEXT, PIPELINE
from ndparallel.plan.models import PRESETS as MODEL_PRESETS
from ndparallel.plan.search.evaluation import DEFAULT_SETTINGS, PlanRequest
from ndparallel.plan.settings import Settings


class _StoreGiven(argparse.Action):
    """``store``, and ``<dest>_given`` set: the user named the value (a default does not)."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, values)
        setattr(namespace, f"{self.dest}_given", True)


@dataclass(frozen=True)
class FieldFlag:
    """The flag of one field (of ``Settings`` or ``PlanRequest``)."""

    field: str
    option: str
    """``--seq-len``, ``--no-sequence-parallel``, ``--fused-adamw``."""
    dest: str
    """The argument's name: the field's, or ``no_FIELD`` for a switch on by default (``negated``)."""
    negated: bool
    how: dict
    """The field's ``flag`` metadata."""

    def value(self, args):
        """The field's value that parsed ``args`` give."""
        value = getattr(args, self.dest, None)
        return not value if self.negated else value


def field_flags(cls: type = Settings, mark: str = "flag") -> dict[str, FieldFlag]:
    """Field name -> its flag, for every field of ``cls`` that declares one (``mark``: ``flag``, or
    ``adapter`` for the flags of the adapter's fields, added after ``--adapter``)."""
    out = {}
    for f in fields(cls):
        how = f.metadata.get(mark)
        if how is not None:
            negated = f.default is True
            dest = f"no_{f.name}" if negated else f.name
            option = "--" + how.get("name", dest.replace("_", "-"))
            out[f.name] = FieldFlag(f.name, option, dest, negated, how)
    return out


def _add_field_arguments(groups: dict, cls: type, defaults: dict) -> None:
    """One flag per ``field_flags(cls)``, in its ``group``: a switch for a boolean, else a value (its
    ``default``, else the field's in ``defaults``; whole numbers for ``positive`` ones)."""
    for ff in field_flags(cls).values():
        t = groups[ff.how["group"]]
        kw = {k: ff.how[k] for k in ("help", "choices", "metavar", "nargs", "const") if k in ff.how}
        default = ff.how.get("default", defaults[ff.field])
        if isinstance(default, bool):
            kw["action"] = "store_true"
        else:
            kw.update(default=default, type=int if ff.how.get("positive") else None)
            if ff.how.get("given"):
                kw["action"] = _StoreGiven
        t.add_argument(ff.option, dest=ff.dest, **kw)


def add_plan_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the planner's options to ``parser``."""
    _add_cluster_arguments(parser.add_argument_group("model and cluster"))
    groups = {name: parser.add_argument_group(name) for name in GROUPS}
    _add_field_arguments(groups, Settings, vars(DEFAULT_SETTINGS))
    _add_batch_arguments(groups[BATCH])
    _add_field_arguments(groups, PlanRequest, {f.name: f.default for f in fields(PlanRequest)})
    _add_adapter_arguments(groups[ADAPTERS])
    _add_host_arguments(groups[LONG_CONTEXT])
    _add_pipeline_arguments(groups[PIPELINE])
    _add_output_arguments(parser.add_argument_group("output"))
    _add_calibration_arguments(parser.add_argument_group("calibration"))


def _add_cluster_arguments(g) -> None:
    """The model, the cluster and its hardware."""
    g.add_argument(
        "--config",
        metavar="TRAIN.yaml",
        help="plan for a training config: its base_model, sequence_len, batch, precision, "
        "optimizer, loss, CP strategy and LoRA become the defaults (flags given here "
        "win); with --write-config, OUT is that config with the planned layout",
    )
    g.add_argument("--model", help=f"preset ({', '.join(MODEL_PRESETS)}) or HF config.json / dir")
    g.add_argument("--gpus", type=int, help="total number of GPUs (world size)")
    g.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node (default 8)")
    g.add_argument(
        "--gpu", default="h100-80gb", help=f"hardware preset: {', '.join(hwmod.PRESETS)} (default h100-80gb)"
    )
    g.add_argument("--hardware-file", help="hardware profile JSON (e.g. from --calibrate)")
    g.add_argument("--gpu-mem", help="override GPU memory, e.g. 80GB (GB = GiB here; a bare number is GB)")
    g.add_argument("--peak-tflops", type=float, help="override dense bf16 peak, TFLOP/s")
    g.add_argument("--intra-node-bw", type=float, help="override NVLink bandwidth, GB/s per GPU")
    g.add_argument("--inter-node-bw", type=float, help="override network bandwidth, GB/s per GPU")
    g.add_argument("--matmul-efficiency", type=float, help="fraction of peak an 8192³ GEMM reaches (0-1)")
    g.add_argument("--hbm-bw", type=float, help="override HBM bandwidth (spec), GB/s")


def _add_batch_arguments(t) -> None:
    """The batch and checkpointing (the search's other choices: ``PlanRequest``'s flags)."""
    gb = t.add_mutually_exclusive_group()
    gb.add_argument("--global-batch-size", type=int, help="sequences per optimizer step")
    gb.add_argument("--global-batch-tokens", type=int, help="tokens per optimizer step")
    t.add_argument("--activation-checkpointing", choices=("auto", "on", "off"), default="auto")


def checkpointing_default(s: Settings) -> dict:
    """The parser's default (argument name -> value) of ``--activation-checkpointing`` that gives
    ``s``'s checkpointing (``plan --config``): on when ``s`` checkpoints, else the parser's own."""
    return {"activation_checkpointing": "on"} if s.checkpointing else {}


def _add_output_arguments(o) -> None:
    """What the planner prints or writes."""
    o.add_argument("--top", type=int, default=10, help="rows of the ranked table (default 10)")
    o.add_argument("--show-rejected", action="store_true", help="list every rejected layout")
    o.add_argument("--json", action="store_true", help="print JSON instead of tables")
    o.add_argument(
        "--explain",
        metavar="LAYOUT",
        help="explain one layout: dp_replicate=2,dp_shard=4,cp=1,tp=8 or 2x4x1x8, with pp=N or "
        "pp16:1x64x1x8 for pipeline stages (optionally mb=2,ac=on,schedule=Interleaved1F1B,v=2,uga=on)",
    )
    o.add_argument(
        "--max-seq-len",
        action="store_true",
        help="find the longest sequence that trains, per layout (micro-batch 1), and "
        "compare the long-context options",
    )
    o.add_argument(
        "--write-config",
        metavar="OUT.yaml",
        help="write the best (or the --explain) layout as a train config",
    )


def _add_calibration_arguments(c) -> None:
    """Measuring this machine (``--calibrate``)."""
    c.add_argument(
        "--calibrate", action="store_true", help="measure this machine and print a hardware profile"
    )
    c.add_argument("--calibrate-ranks", type=int, help="ranks for collective measurements")
    c.add_argument("--calibrate-out", help="save the profile JSON here")
    c.add_argument("--quick", action="store_true", help="fewer/smaller calibration measurements")


def _add_adapter_arguments(t) -> None:
    t.add_argument(
        "--adapter",
        choices=("none", "lora", "qlora"),
        default="none",
        help="lora: LoRA on every linear layer, the base frozen in the compute dtype "
        "(train's adapter: lora, lora_target_linear: true); qlora: the same on a "
        "4-bit NF4 base (train's adapter: qlora, load_in_4bit: true)",
    )
    for ff in field_flags(Settings, "adapter").values():  # the rank
        t.add_argument(ff.option, dest=ff.dest, default=None, **ff.how)
    t.add_argument(
        "--lora-modules-to-save",
        metavar="NAMES",
        default=None,
        help="tables trained in full beside the adapters (train's lora_modules_to_save), "
        "e.g. embed_tokens,lm_head: a trained copy of each (one if tied)",
    )


def _add_pipeline_arguments(t) -> None:
    t.add_argument(
        "--no-pipeline-parallel",
        action="store_true",
        help="search layouts without pipeline parallel (pp = 1) only",
    )


def _add_host_arguments(t) -> None:
    """What the long-context flags need beside their settings."""
    t.add_argument(
        "--host-mem",
        help="host memory per node, e.g. 2TB or 1900GB: with offloading, "
        "layouts needing more than 80 %% of it are rejected (default: not checked)",
    )


_DEGREES = {
    "pp": "pp",
    "pp_size": "pp",
    "pipeline_parallel_size": "pp",
    "dp_replicate": "dp_replicate",
    "dp_replicate_size": "dp_replicate",
    "dr": "dp_replicate",
    "r": "dp_replicate",
    "replicate": "dp_replicate",
    "ddp": "dp_replicate",
    "dp_shard": "dp_shard",
    "dp_shard_size": "dp_shard",
    "ds": "dp_shard",
    "s": "dp_shard",
    "fsdp": "dp_shard",
    "shard": "dp_shard",
    "cp": "cp",
    "cp_size": "cp",
    "c": "cp",
    "context_parallel_size": "cp",
    "tp": "tp",
    "tp_size": "tp",
    "t": "tp",
    "tensor_parallel_size": "tp",
    "ep": "ep",
    "ep_size": "ep",
    "e": "ep",
    "expert_parallel_size": "ep",
}
"""``--explain``'s keys of the layout's degrees -> the ``Layout`` field."""
_FLAG_PINS = {"activation_checkpointing": "checkpointing"}
"""``--explain``'s keys by the name of a flag added here (``--activation-checkpointing``) -> the
``PlanRequest`` field it pins."""


def _pins() -> dict[str, tuple]:
    """``--explain``'s keys that pin one of ``PlanRequest``'s choices per layout (its fields' ``pin``
    metadata: ``plan/field_marks.py``) -> (the field, the reader of its value)."""
    out = {}
    for f in fields(PlanRequest):
        if "pin" in f.metadata:
            aliases, read = f.metadata["pin"]
            out.update({key: (f.name, read) for key in (f.name, *aliases)})
    return out | {key: out[name] for key, name in _FLAG_PINS.items()}


def parse_layout(text: str) -> tuple[ParallelDims, dict]:
    """Parse 'pp=16,dp_replicate=2,dp_shard=4,cp=1,tp=8' (aliases dr/ds/r/s/c/t, ep/e; missing
    dims are 1) or the compact '2x4x1x8' / '2x4x1x8+ep4' / 'pp16:2x4x1x8' (mesh order, optionally
    followed by ',mb=2,ac=on'). Extra keys mb=N, ac=on|off, schedule=NAME, v=N (pipeline
    stages per rank) and uga=on|off (unsharded gradient accumulation) pin the option (``_pins``: the
    ``pin`` metadata of ``PlanRequest``'s fields); they are returned in the second value, by field."""
    text = text.strip()
    values: dict = {}
    extras: dict = {}
    pins = _pins()
    for part in filter(None, re.split(r"[,\s]+", text)):
        compact = re.fullmatch(r"(?:pp(\d+):)?(\d+x\d+x\d+x\d+)(?:\+ep(\d+))?", part)
        if compact and not values:
            values = dict(zip(MESH_DIM_NAMES, (int(v) for v in compact.group(2).split("x"))))
            values.update({k: int(compact.group(i)) for k, i in (("pp", 1), ("ep", 3)) if compact.group(i)})
            continue
        if "=" not in part:
            raise ValueError(f"cannot read {part!r} in layout {text!r}: use key=value or AxBxCxD")
        key, val = (s.strip() for s in part.split("=", 1))
        if key.lower() in _DEGREES:
            values[_DEGREES[key.lower()]] = int(val)
        elif key.lower() in pins:
            name, read = pins[key.lower()]
            extras[name] = read(key, val)
        else:
            raise ValueError(
                f"unknown layout key {key!r} (use pp, dp_replicate, dp_shard, cp, tp, ep, mb, ac, "
                "schedule, v, uga)"
            )
    if not values:
        raise ValueError(f"layout {text!r} names no degree")
    return ParallelDims(**values), extras  # ParallelDims refuses an ep that does not divide dp_shard·cp·tp
