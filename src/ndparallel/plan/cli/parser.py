"""The ``ndparallel plan`` command line: the run's flags from the flag table (``flags.py``), the model,
cluster, output and calibration flags beside them, and the older spellings translated with a note.
A run flag not given is absent from the parsed arguments (``given``): the request takes it from a
training config (``plan --config``) or the planner's default."""

from __future__ import annotations

import argparse
import sys

from ndparallel.plan import hardware as hwmod
from ndparallel.plan.cli.flags import BATCH, DEPRECATED, FLAGS, GROUPS, LONG_CONTEXT, PIPELINE
from ndparallel.plan.models import PRESETS as MODEL_PRESETS


class PlanArgumentParser(argparse.ArgumentParser):
    """argparse whose errors are one line, ``ndparallel plan: error: ...``, exit 2."""

    def error(self, message: str):
        self.exit(2, f"ndparallel plan: error: {message}\n")


def make_parser(description: str = "Rank parallel layouts for a model and cluster.") -> PlanArgumentParser:
    parser = PlanArgumentParser(prog="ndparallel plan", description=description)
    _add_cluster_arguments(parser.add_argument_group("model and cluster"))
    groups = {name: parser.add_argument_group(name) for name in GROUPS}
    for flag in FLAGS:
        kw = {"help": flag.help, "default": argparse.SUPPRESS}
        if flag.switch:
            kw["action"] = argparse.BooleanOptionalAction
        else:
            kw.update(choices=flag.choices, metavar=flag.metavar, type=int if flag.positive else None)
            if flag.optional:
                kw.update(nargs="?", const=flag.optional)
        groups[flag.group].add_argument(flag.option, dest=flag.key, **kw)
    gb = groups[BATCH].add_mutually_exclusive_group()
    gb.add_argument("--global-batch-size", type=int, help="sequences per optimizer step")
    gb.add_argument("--global-batch-tokens", type=int, help="tokens per optimizer step")
    groups[LONG_CONTEXT].add_argument(
        "--host-mem",
        help="host memory per node, e.g. 2TB or 1900GB: with offloading, "
        "layouts needing more than 80 %% of it are rejected (default: the GPU preset's DGX server, "
        "1-2 TB; not checked with a --hardware-file that has none)",
    )
    groups[PIPELINE].add_argument(
        "--no-pipeline-parallel",
        action="store_true",
        help="search layouts without pipeline parallel (pp = 1) only",
    )
    _add_output_arguments(parser.add_argument_group("output"))
    _add_calibration_arguments(parser.add_argument_group("calibration"))
    return parser


def given(args: argparse.Namespace) -> dict:
    """The run flags the command line gave, by key (``flags.FLAGS``)."""
    return {flag.key: getattr(args, flag.key) for flag in FLAGS if hasattr(args, flag.key)}


def parse(argv: list[str] | None = None, description: str | None = None) -> argparse.Namespace:
    """``argv`` parsed, its older spellings (``DEPRECATED``) first translated, one note each."""
    argv = list(sys.argv[1:] if argv is None else argv)
    return make_parser(*([description] if description else [])).parse_args(translate(argv))


def translate(argv: list[str]) -> list[str]:
    """``argv`` with the older spellings of ``DEPRECATED`` written in today's, a note on stderr for
    each spelling used."""
    out, noted = [], set()
    args = iter(argv)
    for arg in args:
        name, eq, value = arg.partition("=")
        new = DEPRECATED.get(name) if name.startswith("--") else None
        if new is None:
            out.append(arg)
            continue
        if isinstance(new, dict):  # a value flag that became one switch per value
            value = value if eq else next(args, "")
            if value not in new:
                choices = ", ".join(map(repr, new))
                raise SystemExit(_fail(f"argument {name}: invalid choice: {value!r} (choose from {choices})"))
            out.append(new[value])
            said = " / ".join(new.values())
        elif isinstance(new, tuple):
            out += list(new)
            said = " ".join(new)
        else:
            out.append(new + eq + value)
            said = new
        if name not in noted:
            noted.add(name)
            print(
                f"ndparallel plan: note: {name} is deprecated: use {said} (the training config's key)",
                file=sys.stderr,
            )
    return out


def _fail(message: str) -> int:
    print(f"ndparallel plan: error: {message}", file=sys.stderr)
    return 2


def _add_cluster_arguments(g) -> None:
    """The model, the cluster and its hardware."""
    g.add_argument(
        "--config",
        metavar="TRAIN.yaml",
        help="plan for a training config: its base_model, sequence_len, batch, precision, "
        "optimizer, loss, CP strategy and LoRA become the defaults (flags given here "
        "win); with --write-config, OUT is that config with the planned layout",
    )
    g.add_argument("--base-model", help=f"preset ({', '.join(MODEL_PRESETS)}) or HF config.json / dir")
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


def _add_output_arguments(o) -> None:
    """What the planner prints or writes."""
    o.add_argument("--top", type=int, default=10, help="rows of the ranked table (default 10)")
    o.add_argument("--show-rejected", action="store_true", help="list every rejected layout")
    o.add_argument("--json", action="store_true", help="print JSON instead of tables")
    o.add_argument(
        "--explain",
        metavar="LAYOUT",
        help="explain one layout: dp_replicate_size=2,dp_shard_size=4,tensor_parallel_size=8 (the "
        "training config's keys; a missing degree is 1) or 2x4x1x8 (dp_replicate x dp_shard x cp x tp), "
        "pp16:1x64x1x8 with pipeline stages; optionally pinning micro_batch_size=2, "
        "activation_checkpointing=on, pipeline_schedule=Interleaved1F1B, pipeline_virtual_stages=2, "
        "unsharded_grad_accumulation=on",
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
