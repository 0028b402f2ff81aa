"""``ndparallel train | verify | export | plot``: argument parsing and error reporting.

Bad input ends with one line on stderr and exit code 2, never a traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Sequence

from ndparallel.training.config import ConfigError, load_config
from ndparallel.training.preflight import describe_plan, validate_layout, world_size_for


def _fail(command: str, message: str) -> int:
    print(f"ndparallel {command}: error: {message}", file=sys.stderr)
    return 2


def _config_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", nargs="?", help="YAML config (Axolotl field names); default: built-in quickstart")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config field (dotted keys for nested ones); repeatable")


def run_train(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="ndparallel train", description="train from a YAML config")
    _config_args(parser)
    parser.add_argument("--dry-run", action="store_true", help="print the resolved plan and exit")
    parser.add_argument("--nproc-per-node", type=int, default=None,
                        help="ranks on this machine (default: the product of the degrees)")
    parser.add_argument("--profile-comm", action="store_true",
                        help="count collectives and bytes per mesh dim during the first step")
    args = parser.parse_args(list(argv))
    try:
        cfg = load_config(args.config, args.set)
        world = world_size_for(cfg, args.nproc_per_node)
        # a dry run checks the layout of a config meant for another machine: data may live there
        pc, hf = validate_layout(cfg, world, check_data=not args.dry_run)
    except ConfigError as e:
        return _fail("train", str(e))
    in_job = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    if args.dry_run:
        if not in_job or os.environ.get("RANK") == "0":
            print(describe_plan(cfg, pc, hf))
        return 0
    if not in_job:
        from ndparallel.runtime.launch import relaunch_self

        inner = ["train", *([args.config] if args.config else []), *(f"--set={s}" for s in args.set)]
        if args.profile_comm:
            inner.append("--profile-comm")
        return relaunch_self(world, inner, torchrun_args=[f"--max-restarts={cfg.max_restarts}"])
    from ndparallel.training.trainer import run_training

    try:
        run_training(cfg, profile_comm=args.profile_comm)
    except (ValueError, FileNotFoundError) as e:
        # Bad data / model / checkpoint found on the ranks: one line from rank 0, non-zero exit on
        # every rank (the elastic agent then stops any rank still waiting in a collective).
        if os.environ.get("RANK") == "0":
            print(f"ndparallel train: error: {e}", file=sys.stderr)
        return 2
    if os.environ.get("RANK") == "0":
        _plot_curves(Path(cfg.output_dir))
    return 0


def _plot_curves(out: Path) -> None:
    """The loss / throughput PNG next to metrics.jsonl (skipped without matplotlib)."""
    try:
        from ndparallel.tools.plot import plot_run

        print(f"loss curve: {plot_run(out)}")
    except ImportError:
        print("loss curve: skipped (pip install matplotlib, then `ndparallel plot` the run)")


def run_verify(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="ndparallel verify",
        description="train a shrunk model of the config's architecture under its layout and on one "
                    "process (CPU), and compare losses and gradient norms")
    _config_args(parser)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--tolerance", type=float, default=1e-5, help="max relative loss/grad-norm error")
    parser.add_argument("--inject-fault", choices=["skip-grad-sync", "cross-documents"], default=None,
                        help=argparse.SUPPRESS)  # proves the check can fail (tests)
    args = parser.parse_args(list(argv))
    try:
        cfg = load_config(args.config, args.set)
        world = world_size_for(cfg, None)
        pc, hf = validate_layout(cfg, world, check_data=False)  # verify uses synthetic data
    except ConfigError as e:
        return _fail("verify", str(e))
    from ndparallel.tools.verify import verify_layout

    ok = verify_layout(cfg, pc, hf, steps=args.steps, tolerance=args.tolerance, fault=args.inject_fault)
    return 0 if ok else 1


def run_export(argv: Sequence[str]) -> int:
    from ndparallel.cli.export import export_main

    return export_main(list(argv))


def run_plot(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="ndparallel plot", description="plot a run's metrics.jsonl")
    parser.add_argument("run_dir")
    parser.add_argument("--out", default=None, help="PNG path (default: RUN_DIR/metrics.png)")
    args = parser.parse_args(list(argv))
    from ndparallel.tools.plot import plot_run

    try:
        path = plot_run(Path(args.run_dir), Path(args.out) if args.out else None)
    except (FileNotFoundError, ValueError) as e:
        return _fail("plot", str(e))
    print(f"wrote {path}")
    return 0
