"""The ``ndparallel`` command line: launch, train, preprocess, verify, plan, simulate, export, plot."""

from __future__ import annotations

import difflib
import os
import sys
from collections.abc import Sequence

from ndparallel.cli import commands
from ndparallel.cli.args import fail
from ndparallel.cli.launch_check import check_train_launch
from ndparallel.cli.plan_config import config_values, merge_written_config
from ndparallel.cli.simulate_command import run_simulate
from ndparallel.config import ConfigError
from ndparallel.plan.cli.main import run_plan
from ndparallel.plan.cli.parser import parse as parse_plan
from ndparallel.runtime import launch
from ndparallel.runtime.extras import MissingExtra
from ndparallel.runtime.preemption import INTERRUPTED_EXIT
from ndparallel.runtime.quiet import quiet_library_noise

_SUBCOMMANDS = {
    "launch": "run a script on N ranks (all torchrun options accepted)",
    "train": "train a model from a YAML config (starts its own ranks on one machine)",
    "preprocess": "tokenize and cache a config's datasets; show samples with their trained tokens",
    "verify": "check a layout trains the same model as one device (shrunk, on CPU)",
    "plan": "rank the parallel layouts for a model and cluster by memory and step time",
    "simulate": "run one real rank of an N-rank world here (fake collectives) against the planner",
    "export": "turn a sharded checkpoint into a Hugging Face safetensors directory",
    "plot": "draw a run's loss and throughput curves to a PNG",
}


def _usage() -> str:
    rows = "\n".join(f"  {name:<10} {text}" for name, text in _SUBCOMMANDS.items())
    return f"usage: ndparallel <command> [options]\n\ncommands:\n{rows}\n\n`ndparallel <command> -h` for help"


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; returns its exit code (2: bad input, reported in one line on stderr)."""
    argv = list(sys.argv[1:] if argv is None else argv)

    quiet_library_noise()
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0 if argv else 2
    try:
        return _dispatch(argv[0], argv[1:])
    except MissingExtra as e:  # a feature asked for whose optional extra is not installed: one line
        return fail(argv[0], e)
    except SystemExit as e:  # argparse (-h: 0, a usage error: 2, already printed in one line)
        return e.code if isinstance(e.code, int) else (0 if e.code is None else _fail_text(e.code))
    except KeyboardInterrupt:  # Ctrl-C outside training (start-up, rendezvous): one line, no traceback
        if os.environ.get("RANK", "0") == "0":
            print(f"ndparallel {argv[0]}: interrupted (Ctrl-C)", file=sys.stderr)
        return INTERRUPTED_EXIT


def _dispatch(command: str, rest: list[str]) -> int:
    if command == "launch":
        problem = check_train_launch(rest)  # `launch ... -m ndparallel train CFG`: its checks first
        if problem:
            print(f"ndparallel launch: error: {problem}", file=sys.stderr)
            return 2
        return launch.launch(rest)
    if command == "plan":
        return _plan(rest)
    if command == "simulate":
        return run_simulate(rest)
    if command in ("train", "preprocess", "verify", "export", "plot"):
        return getattr(commands, f"run_{command}")(rest)
    close = difflib.get_close_matches(command, list(_SUBCOMMANDS), n=1, cutoff=0.6)
    hint = f"; did you mean {close[0]!r}?" if close else f"; commands: {', '.join(_SUBCOMMANDS)}"
    print(f"ndparallel: error: unknown command {command!r}{hint} (see ndparallel -h)", file=sys.stderr)
    return 2


def _plan(argv: list[str]) -> int:
    """``plan``, with ``--config TRAIN.yaml``: the config's values under the flags given."""
    args = parse_plan(argv, description=_SUBCOMMANDS["plan"])
    if args.config is None:  # flags only: the planner alone, no torch import (a fast start)
        return run_plan(args)
    try:
        base, said, rows = config_values(args.config, args)
    except (ConfigError, ValueError) as e:
        print(f"ndparallel plan: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    print(said, file=sys.stderr)
    code = run_plan(args, base, {"rows": rows.to_dict()} if rows else None)
    if code == 0 and args.write_config and os.path.isfile(args.write_config):
        merge_written_config(args.config, args.write_config)
    return code


def _fail_text(text: object) -> int:
    print(" ".join(str(text).split()), file=sys.stderr)
    return 1
