"""``ndparallel launch [torchrun options] -m ndparallel train CONFIG``: the training config is
checked against the launch before any rank starts — its layout against the world size
(``--nnodes`` × ``--nproc-per-node``) and tensor parallelism against the node size (tp groups
must not span nodes)."""

from __future__ import annotations

from collections.abc import Sequence

from ndparallel.axolotl import ConfigError, load_config
from ndparallel.cli.commands import check_nodes
from ndparallel.runtime.launch import torchrun_parser


class _Unparsable(Exception):
    pass


def train_command(argv: Sequence[str]):
    """(config path or None, --set overrides, parsed torchrun args) when ``argv`` launches
    ``-m ndparallel train``; else None."""
    argv = list(argv)
    if "ndparallel" not in argv or "train" not in argv or {"-h", "--help"} & set(argv):
        return None
    parser = torchrun_parser()

    def unparsable(*_args, **_kwargs):
        raise _Unparsable

    parser.error = parser.exit = unparsable  # type: ignore[method-assign]  # silent: launch() reports it
    try:
        args = parser.parse_args(argv)
    except _Unparsable:
        return None
    rest = list(args.training_script_args)
    if not (args.module and args.training_script == "ndparallel" and rest[:1] == ["train"]):
        return None
    config, sets, i = None, [], 1
    while i < len(rest):
        arg = rest[i]
        if arg == "--set" and i + 1 < len(rest):
            sets.append(rest[i + 1])
            i += 1
        elif arg.startswith("--set="):
            sets.append(arg.split("=", 1)[1])
        elif not arg.startswith("-") and config is None:
            config = arg
        i += 1
    return config, sets, args


def check_train_launch(argv: Sequence[str]) -> str | None:
    """One line saying why this launch of ``ndparallel train`` cannot work, or None."""
    found = train_command(argv)
    if found is None:
        return None
    config, sets, args = found
    nproc, nnodes = str(args.nproc_per_node), str(args.nnodes)
    if not nproc.isdigit() or not nnodes.isdigit():
        return None  # "gpu"/"auto" or an elastic range: the ranks check for themselves
    from ndparallel.preflight.checks import validate_layout

    world = int(nproc) * int(nnodes)
    try:
        cfg = load_config(config, sets)
        check_nodes(cfg, world, int(nproc))
        validate_layout(cfg, world, check_local=False)
    except (ConfigError, ValueError) as e:
        return " ".join(str(e).split())
    return None
