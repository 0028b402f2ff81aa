"""The ``ndparallel`` command line: launch, train, verify, plan, export, plot."""

from __future__ import annotations

import sys
from typing import Sequence

_SUBCOMMANDS = {
    "launch": "run a script on N ranks (all torchrun options accepted)",
    "train": "train a model from a YAML config (starts its own ranks on one machine)",
    "verify": "check a layout trains the same model as one device (shrunk, on CPU)",
    "plan": "rank the parallel layouts for a model and cluster by memory and step time",
    "export": "turn a sharded checkpoint into a Hugging Face safetensors directory",
    "plot": "draw a run's loss and throughput curves to a PNG",
}


def _usage() -> str:
    rows = "\n".join(f"  {name:<8} {text}" for name, text in _SUBCOMMANDS.items())
    return f"usage: ndparallel <command> [options]\n\ncommands:\n{rows}\n\n`ndparallel <command> -h` for help"


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "launch":
        from ndparallel.runtime.launch import launch

        return launch(rest)
    if command == "plan":
        from ndparallel.plan.cli import main as plan_main

        return plan_main(rest, description=_SUBCOMMANDS["plan"])
    if command in ("train", "verify", "export", "plot"):
        from ndparallel.cli import commands

        return getattr(commands, f"run_{command}")(rest)
    print(f"ndparallel: unknown command {command!r}\n\n{_usage()}", file=sys.stderr)
    return 2
