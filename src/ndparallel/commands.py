"""``ndparallel train | verify | export | plot``: argument parsing and error reporting.

Bad input ends with one line on stderr and exit code 2, never a traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Sequence

from ndparallel.config import ConfigError, TrainConfig, load_config


def _fail(command: str, message: str) -> int:
    print(f"ndparallel {command}: error: {message}", file=sys.stderr)
    return 2


def _config_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", nargs="?", help="YAML config (Axolotl field names); default: built-in quickstart")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config field (dotted keys for nested ones); repeatable")


def validate_layout(cfg: TrainConfig, world_size: int, check_data: bool = True):
    """Check the layout against the world size and the model (and that local data exists) before
    any rank starts. Returns (resolved ParallelismConfig, HF model config)."""
    from ndparallel.parallelism_config import ParallelismConfigError
    from ndparallel.train import model_config

    try:
        pc = cfg.parallelism_config().resolve(world_size)
    except ParallelismConfigError as e:
        raise ConfigError(str(e)) from None
    # A well-known hub id that is not on disk is validated with its published numbers: no network
    # round trip (or long retries on an offline machine) before the ranks start.
    hf = None if Path(cfg.base_model).exists() else known_config_offline(cfg.base_model)
    if hf is None:
        try:
            hf = model_config(cfg, vocab_size=cfg.tokenizer_vocab_size)
        except (OSError, ValueError) as e:
            raise ConfigError(f"base_model={cfg.base_model!r} cannot be read: {e}") from None
    if check_data:
        _check_datasets(cfg)
    try:
        if pc.tp_enabled:
            from ndparallel.parallel.tensor import validate_tensor_parallel

            validate_tensor_parallel(hf, pc.tp_size, cfg.tp_options())
        if pc.cp_enabled:
            from ndparallel.parallel.context import validate_context_parallel

            validate_context_parallel(hf, pc.cp_size, cfg.sequence_len, pc.tp_size)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    return pc, hf


def _check_datasets(cfg: TrainConfig) -> None:
    """Local dataset files must exist before ranks start (hub names are checked when loaded)."""
    from ndparallel.data.dataset import looks_local

    for i, d in enumerate(cfg.datasets):
        if d.path.startswith("builtin:"):
            continue
        if looks_local(d.path) and not Path(d.path).expanduser().exists():
            raise ConfigError(f"datasets[{i}].path={d.path!r} does not exist: fix the path "
                              "(relative paths are taken from the current directory)")


def known_config_offline(hub_id: str):
    """The HF config of a well-known hub model from the planner's published numbers, so a layout
    can be validated (``--dry-run``) on a machine that cannot reach the hub."""
    from transformers import AutoConfig

    from ndparallel.plan.models import PRESETS

    spec = next((m for m in PRESETS.values() if m.hf_id == hub_id), None)
    if spec is None:
        return None
    model_type = "qwen3" if spec.qk_norm else ("mistral" if "mistral" in hub_id.lower() else "llama")
    return AutoConfig.for_model(
        model_type, hidden_size=spec.hidden, num_hidden_layers=spec.layers,
        num_attention_heads=spec.heads, num_key_value_heads=spec.kv_heads,
        intermediate_size=spec.intermediate, vocab_size=spec.vocab, head_dim=spec.head_dim,
        tie_word_embeddings=spec.tied_embeddings,
    )


def _world_size(cfg: TrainConfig, nproc: int | None) -> int:
    if "WORLD_SIZE" in os.environ:
        return int(os.environ["WORLD_SIZE"])
    sizes = [cfg.dp_replicate_size, cfg.dp_shard_size, cfg.tensor_parallel_size, cfg.context_parallel_size]
    if -1 in sizes:
        if not nproc:
            raise ConfigError("a degree is -1 (fill from the world size): pass --nproc-per-node N")
        return nproc
    total = 1
    for s in sizes:
        total *= s
    if nproc and nproc != total:
        raise ConfigError(f"--nproc-per-node {nproc} but the layout needs {total} ranks")
    return total


def describe_plan(cfg: TrainConfig, pc, hf) -> str:
    """The resolved run, as printed by ``--dry-run``."""
    gbs = cfg.micro_batch_size * cfg.gradient_accumulation_steps * pc.dp_size
    lines = [
        f"layout       : {pc.describe()}  ({pc!r})",
        f"model        : {cfg.base_model} ({hf.model_type}, {hf.num_hidden_layers} layers, hidden "
        f"{hf.hidden_size}, heads {hf.num_attention_heads}/{getattr(hf, 'num_key_value_heads', '?')})",
        f"global batch : {gbs} sequences × {cfg.sequence_len} tokens = {gbs * cfg.sequence_len} tokens/step "
        f"(micro {cfg.micro_batch_size} × accum {cfg.gradient_accumulation_steps} × dp {pc.dp_size})",
        f"per rank     : {cfg.micro_batch_size} × {cfg.sequence_len // pc.cp_size} tokens per micro-batch"
        + (f" (sequence split over cp={pc.cp_size})" if pc.cp_enabled else ""),
        f"fsdp         : {cfg.fsdp_config.model_dump()}",
        f"precision    : {'bf16 compute, fp32 master weights' if cfg.bf16 else 'fp32'}",
        f"steps        : {cfg.max_steps or f'{cfg.num_epochs} epochs'}; lr {cfg.learning_rate} "
        f"({cfg.lr_scheduler}, warmup {cfg.warmup_steps})",
        f"output       : {cfg.output_dir}",
    ]
    return "\n".join(lines)


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
        world = _world_size(cfg, args.nproc_per_node)
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
        from ndparallel.launch import relaunch_self

        inner = ["train", *([args.config] if args.config else []), *(f"--set={s}" for s in args.set)]
        if args.profile_comm:
            inner.append("--profile-comm")
        return relaunch_self(world, inner, torchrun_args=[f"--max-restarts={cfg.max_restarts}"])
    from ndparallel.train import run_training

    try:
        run_training(cfg, profile_comm=args.profile_comm)
    except (ValueError, FileNotFoundError) as e:
        # Bad data / model / checkpoint found on the ranks: one line from rank 0, non-zero exit on
        # every rank (the elastic agent then stops any rank still waiting in a collective).
        if os.environ.get("RANK") == "0":
            print(f"ndparallel train: error: {e}", file=sys.stderr)
        return 2
    return 0


def run_verify(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="ndparallel verify",
        description="train a shrunk model of the config's architecture under its layout and on one "
                    "process (CPU), and compare losses and gradient norms")
    _config_args(parser)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--tolerance", type=float, default=1e-5, help="max relative loss/grad-norm error")
    parser.add_argument("--inject-fault", choices=["skip-grad-sync"], default=None,
                        help=argparse.SUPPRESS)  # proves the check can fail (tests)
    args = parser.parse_args(list(argv))
    try:
        cfg = load_config(args.config, args.set)
        world = _world_size(cfg, None)
        pc, hf = validate_layout(cfg, world, check_data=False)  # verify uses synthetic data
    except ConfigError as e:
        return _fail("verify", str(e))
    from ndparallel.verify import verify_layout

    ok = verify_layout(cfg, pc, hf, steps=args.steps, tolerance=args.tolerance, fault=args.inject_fault)
    return 0 if ok else 1


def run_export(argv: Sequence[str]) -> int:
    from ndparallel.export import export_main

    return export_main(list(argv))


def run_plot(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="ndparallel plot", description="plot a run's metrics.jsonl")
    parser.add_argument("run_dir")
    parser.add_argument("--out", default=None, help="PNG path (default: RUN_DIR/metrics.png)")
    args = parser.parse_args(list(argv))
    from ndparallel.plot import plot_run

    try:
        path = plot_run(Path(args.run_dir), Path(args.out) if args.out else None)
    except (FileNotFoundError, ValueError) as e:
        return _fail("plot", str(e))
    print(f"wrote {path}")
    return 0
