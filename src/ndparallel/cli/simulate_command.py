"""``ndparallel simulate CONFIG --world-size N``: argument parsing, the checks ``train`` makes
before launch, and the exit code (0: ran, and fits ``--gpu-mem`` if given; 1: does not fit or
failed; 2: bad input)."""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence

from ndparallel.axolotl import ConfigError, load_config
from ndparallel.cli.args import Parser, at_least, fail
from ndparallel.plan.cli.flag_checks import gpu_mem_bytes
from ndparallel.runtime.startup import import_model_libraries
from ndparallel.tools.simulate_report import format_report


def run_simulate(argv: Sequence[str]) -> int:
    parser = Parser(
        prog="ndparallel simulate",
        description="run one real rank of an N-rank world here (fake collectives) and compare its "
        "memory, compute time and collectives with the planner's prediction",
    )
    parser.add_argument("config", help="the training YAML (as `ndparallel train` reads it)")
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="override a config field"
    )
    parser.add_argument("--world-size", type=at_least(1), required=True, help="ranks of the simulated world")
    parser.add_argument("--rank", type=at_least(0), default=0, help="which rank to run (default 0)")
    parser.add_argument(
        "--steps", type=at_least(1), default=3, help="timed steps after one warm-up (default 3)"
    )
    parser.add_argument(
        "--gpus-per-node", type=at_least(1), default=8, help="for the planner's links (default 8)"
    )
    parser.add_argument(
        "--gpu-mem",
        default=None,
        metavar="SIZE",
        help="device memory budget (e.g. 80GB = 80 GiB): exit 1 if the measured peak exceeds it",
    )
    parser.add_argument("--gpu", default=None, help="planner hardware preset (default: this GPU's)")
    parser.add_argument("--hardware-file", default=None, help="planner hardware profile (plan --calibrate)")
    parser.add_argument(
        "--save-checkpoint",
        default=None,
        metavar="DIR",
        help="also write this rank's DCP checkpoint shards to DIR: time and bytes",
    )
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parser.parse_args(list(argv))
    from ndparallel.preflight.checks import validate_layout

    try:
        gpu_mem = None if args.gpu_mem is None else gpu_mem_bytes(args.gpu_mem, minimum=0)
        cfg = load_config(args.config, args.set)
        import_model_libraries()  # the config is readable: what builds the model, collector paused
        if args.rank >= args.world_size:
            raise ConfigError(
                f"--rank {args.rank} is not in a world of {args.world_size} ranks: "
                f"use 0 <= --rank < --world-size"
            )
        # every check train makes before launch, at the simulated world size; output_dir is not
        # written (a simulation leaves no run behind)
        validate_layout(cfg, args.world_size, check_local=True, check_output=False, check_weights=False)
    except (ConfigError, ValueError) as e:
        return fail("simulate", e)
    from ndparallel.tools.simulate import SimulationRequest, run_in_child

    req = SimulationRequest(
        world_size=args.world_size,
        rank=args.rank,
        steps=args.steps,
        gpus_per_node=args.gpus_per_node,
        gpu_mem=gpu_mem,
        gpu=args.gpu,
        hardware_file=args.hardware_file,
        save_checkpoint=args.save_checkpoint,
    )
    try:
        report = run_in_child(args.config, args.set, req)
    except RuntimeError as e:
        print(f"ndparallel simulate: {e}", file=sys.stderr)
        return 1
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    if report["fits"] is False:
        print(
            f"ndparallel simulate: the layout does not fit: measured peak "
            f"{report['measured']['peak_memory_gib']:.2f} GiB > --gpu-mem {args.gpu_mem}",
            file=sys.stderr,
        )
        return 1
    return 0
