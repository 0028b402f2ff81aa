"""``ndparallel train | preprocess | verify | export | plot``: argument parsing and error reporting.

Bad input ends with one line on stderr and exit code 2, never a traceback.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from ndparallel.axolotl import ConfigError, load_config
from ndparallel.cli.args import Parser, at_least, fail
from ndparallel.layout.config import ParallelismConfigError
from ndparallel.models.families import is_tested_family
from ndparallel.preflight.world import run_device, world_size_for
from ndparallel.runtime import launch
from ndparallel.runtime.extras import MissingExtra
from ndparallel.runtime.lifeline import die_with_launcher
from ndparallel.runtime.preemption import INTERRUPTED_EXIT, PREEMPTED_EXIT, Preempted
from ndparallel.runtime.startup import import_model_libraries
from ndparallel.tools.plot import plot_run

INPUT_ERRORS = (ValueError, OSError)
"""Raised on the ranks for bad data, model, checkpoint or output_dir: reported as one line, exit 2
(anything else is a bug or a machine fault: its traceback is shown, exit 1)."""


def _config_args(parser: Parser) -> None:
    parser.add_argument(
        "config", nargs="?", help="YAML config (Axolotl field names); default: built-in quickstart"
    )
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config field (dotted keys for nested ones); repeatable",
    )


def run_train(argv: Sequence[str]) -> int:
    parser = Parser(prog="ndparallel train", description="train from a YAML config")
    _config_args(parser)
    parser.add_argument("--dry-run", action="store_true", help="print the resolved plan and exit")
    parser.add_argument(
        "--nproc-per-node",
        type=int,
        default=None,
        help="ranks on this machine (default: the product of the degrees)",
    )
    parser.add_argument(
        "--profile-comm",
        action="store_true",
        help="count collectives and bytes per mesh dim during the first step",
    )
    parser.add_argument(
        "--skip-family-check",
        action="store_true",
        help="launch a model family outside the tested set without first checking a "
        "shrunk copy of it under the layout (docs/families.md)",
    )
    args = parser.parse_args(list(argv))
    in_job = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    if in_job and not args.dry_run:
        die_with_launcher()  # a rank never outlives its launcher (kill -9 of torchrun / ndparallel launch)
    try:
        cfg = load_config(args.config, args.set)
        world = world_size_for(cfg, args.nproc_per_node)
        import_model_libraries()  # the config is readable: what builds the model, collector paused
        from ndparallel.preflight.checks import run_checks  # imports torch: after the config is read

        checked_before_launch = in_job and launch.launched_by_ndparallel() and not args.dry_run
        if not checked_before_launch:
            # A dry run checks a config meant for another machine: its data may live there. Under
            # torchrun every rank checks (output_dir: rank 0 only, before its first write).
            found = run_checks(
                cfg,
                world,
                check_local=not args.dry_run,
                check_output=not in_job,
                device_type=run_device(cfg) if args.dry_run else None,
            )
        if in_job:
            check_nodes(cfg, world, int(os.environ.get("LOCAL_WORLD_SIZE", world)))
    except ConfigError as e:
        return _rank_error("train", e) if in_job else fail("train", e)
    main_rank = not in_job or os.environ.get("RANK") == "0"
    if args.dry_run:
        if main_rank:
            from ndparallel.preflight.plan_text import describe_plan

            print(describe_plan(cfg, found.pc, found.hf, found.notes, found.summaries, found.meta_model))
        return 0
    if not in_job:
        if not args.skip_family_check:
            problem = _family_check(cfg, found.pc, found.hf)
            if problem:
                return fail("train", problem)
        for note in found.notes:
            print(f"ndparallel train: note: {note}")
        if world == 1 and cfg.max_restarts == 0:  # nothing to restart, no peers: no agent either
            return launch.run_here(lambda: _train_on_rank(cfg, args.profile_comm, main_rank=True, alone=True))
        inner = ["train", *([args.config] if args.config else []), *(f"--set={s}" for s in args.set)]
        if args.profile_comm:
            inner.append("--profile-comm")
        return launch.relaunch_self(
            world,
            inner,
            torchrun_args=[
                f"--max-restarts={cfg.max_restarts}",
                *shutdown_grace_args(cfg.preemption_timeout_s),
            ],
        )
    return _train_on_rank(cfg, args.profile_comm, main_rank)


def _train_on_rank(cfg, profile_comm: bool, main_rank: bool, alone: bool = False) -> int:
    """One rank of ``ndparallel train``: the run, and how it ended as an exit code. ``alone``: the
    only rank, in the command's own process (``launch.run_here``): a failure returns its code (no peer can
    be waiting in a collective, so its one-rank group is destroyed safely)."""
    import sys

    from ndparallel.engine.nonfinite import NonFiniteError
    from ndparallel.runtime.distributed import shutdown
    from ndparallel.training.stopping import Interrupted, interrupted_line
    from ndparallel.training.trainer import run_training

    try:
        run_training(cfg, profile_comm=profile_comm)
    except Preempted as e:  # every rank, after the agreed step's checkpoint
        if main_rank:
            print(e, file=sys.stderr, flush=True)
        shutdown()
        return PREEMPTED_EXIT
    except (Interrupted, KeyboardInterrupt) as e:  # Ctrl-C: one line, no traceback (peers may be gone)
        if main_rank:
            print(interrupted_line(getattr(e, "step", None), cfg.output_dir), file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(INTERRUPTED_EXIT)  # now: not after a background checkpoint write (left without a marker)
    except NonFiniteError as e:  # every rank sees the same global loss / grad norm: exit 1
        return _failed(_rank_error("train", e, exit_code=1), alone)
    except INPUT_ERRORS as e:
        # Bad data / model / checkpoint / output_dir found on the ranks: non-zero exit on every
        # failing rank (the elastic agent then stops any rank still waiting in a collective); the
        # launcher prints the first failing rank's line once. NDPARALLEL_TRACEBACK=1 shows it.
        if isinstance(e, (TimeoutError, ConnectionError)) or os.environ.get("NDPARALLEL_TRACEBACK") == "1":
            raise  # a machine fault, not an input, or asked for
        return _failed(_rank_error("train", e), alone)
    if main_rank:
        _plot_curves(Path(cfg.output_dir))
    return 0


def _failed(code: int, alone: bool) -> int:
    if not alone:
        _exit_failed_rank(code)
    from ndparallel.runtime.distributed import shutdown

    shutdown()
    return code


def _exit_failed_rank(code: int) -> None:
    """Leave a failed rank now, with ``code``. Its process group is still up (a peer may be waiting
    in a collective, so it cannot be destroyed safely), and letting the interpreter tear it down
    can abort the process (``terminate called without an active exception``, exit -6) after the
    error was reported: the launcher would then see a crash instead of exit ``code``."""
    import sys

    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def check_nodes(cfg, world: int, ranks_per_node: int) -> None:
    """Tensor parallelism stays within a node: refused (``ConfigError``) when its groups would
    span nodes of ``ranks_per_node`` ranks."""

    try:
        dims = cfg.parallelism_config().resolve(world).dims
    except ParallelismConfigError as e:
        raise ConfigError(str(e)) from None
    problem = dims.tp_across_nodes(ranks_per_node)
    if problem:
        raise ConfigError(problem)


def shutdown_grace_args(preemption_timeout_s: float) -> list[str]:
    """torchrun's ``--shutdown-timeout``: the agent waits this long for signalled ranks to save
    and exit before SIGKILL (the preemption deadline plus room to exit)."""
    if not any("--shutdown-timeout" in a.option_strings for a in launch.torchrun_parser()._actions):
        return []  # an older torch: TORCH_ELASTIC_SHUTDOWN_TIMEOUT / its 30 s default
    return [f"--shutdown-timeout={int(preemption_timeout_s) + 20}"]


def _family_check(cfg, pc, hf) -> str | None:
    """A family outside the tested set: its layout checked on a shrunk copy first (CPU, seconds)."""

    if is_tested_family(hf) or not (pc.tp_enabled or pc.cp_enabled or pc.dp_size > 1):
        return None
    from ndparallel.tools.family_check import family_check

    print(
        f"ndparallel train: {hf.model_type!r} is not among the tested families: checking a shrunk copy "
        "under this layout against one process first (CPU, seconds; --skip-family-check skips it)"
    )
    return family_check(cfg, pc, hf)


def _rank_error(command: str, error: BaseException, exit_code: int | None = None) -> int:
    launch.report_rank_error(f"ndparallel {command}: error: {' '.join(str(error).split())}")
    return launch.INPUT_ERROR_EXIT if exit_code is None else exit_code


def _plot_curves(out: Path) -> None:
    """The loss / throughput PNG next to metrics.jsonl (skipped, said once, without matplotlib: a
    run that did not ask for the plot extra trains all the same)."""
    try:
        print(f"loss curve: {plot_run(out)}")
    except MissingExtra:
        print(
            "loss curve: skipped: no matplotlib here (pip install 'ndparallel[plot]', then "
            f"`ndparallel plot {out}`)"
        )


def run_preprocess(argv: Sequence[str]) -> int:
    parser = Parser(
        prog="ndparallel preprocess",
        description="tokenize (and cache) the config's datasets as train would; print a summary",
    )
    _config_args(parser)
    parser.add_argument(
        "--show",
        type=at_least(1),
        default=None,
        metavar="N",
        help="print N samples with the trained tokens highlighted",
    )
    parser.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object per sample (input_ids, labels; before packing); with --show N: N",
    )
    args = parser.parse_args(list(argv))
    from ndparallel.tools.preprocess import preprocess

    try:
        cfg = load_config(args.config, args.set)
        preprocess(cfg, show=args.show, as_json=args.json)
    except (ConfigError, ValueError, OSError) as e:
        return fail("preprocess", e)
    return 0


def run_verify(argv: Sequence[str]) -> int:
    parser = Parser(
        prog="ndparallel verify",
        description="train a shrunk model of the config's architecture under its layout and options and on "
        "one process (CPU), through the trainer's own step; compare losses, gradient norms and "
        "parameters after SGD steps (and, with bf16/fp8, the same at that precision)",
    )
    _config_args(parser)
    parser.add_argument("--steps", type=at_least(1), default=3, help="optimizer steps (>= 1)")
    args = parser.parse_args(list(argv))
    try:
        cfg = load_config(args.config, args.set)
        world = world_size_for(cfg, None)
        import_model_libraries()
        from ndparallel.preflight.checks import validate_layout  # imports torch: after the config is read

        pc, hf = validate_layout(cfg, world, check_local=False)  # verify uses synthetic data
    except ConfigError as e:
        return fail("verify", e)
    from ndparallel.tools.verify import verify_layout

    ok = verify_layout(cfg, pc, hf, steps=args.steps)
    return 0 if ok else 1


def run_export(argv: Sequence[str]) -> int:
    from ndparallel.cli.export_command import export_main

    return export_main(list(argv))


def run_plot(argv: Sequence[str]) -> int:
    parser = Parser(prog="ndparallel plot", description="plot a run's metrics.jsonl")
    parser.add_argument("run_dir")
    parser.add_argument("--out", default=None, help="PNG path (default: RUN_DIR/metrics.png)")
    args = parser.parse_args(list(argv))

    default = Path(args.run_dir) / "metrics.png"
    if args.out is None and default.exists() and not _run_wrote(default):
        return fail(
            "plot",
            f"{default} exists and no ndparallel run wrote it: pass --out PATH (it is never overwritten)",
        )
    try:
        path = plot_run(Path(args.run_dir), Path(args.out) if args.out else None)
    except (FileNotFoundError, ValueError, MissingExtra) as e:
        return fail("plot", e)
    print(f"wrote {path}")
    return 0


def _run_wrote(path: Path) -> bool:
    """``path`` is claimed by the run record of its directory (a directory without one: no)."""
    from ndparallel.checkpoint.ownership import read_run

    run = read_run(path.parent)
    return run is not None and path.name in run["written"]
