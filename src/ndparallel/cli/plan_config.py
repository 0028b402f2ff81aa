"""``ndparallel plan --config TRAIN.yaml``: plan for a training config.

The config's model and training settings become the planner parser's defaults, as typed values
(``config_defaults``: ``config/plan_settings.py``'s ``Settings``, each field as its flag's default:
``plan/cli/main.py``'s ``flag_defaults``), so a flag given on the command line wins. The global batch is the
config's: ``micro_batch_size × gradient_accumulation_steps × dp`` of its own layout at ``--gpus``
(the planner then keeps it fixed while it searches layouts and micro-batches). With
``--write-config OUT``, OUT is the user's config with only the layout and batch fields replaced by
the plan's choice (everything else — data, optimizer, LoRA, output_dir — kept).

Lives in ``cli/`` because it reads the training config (``training/``), which ``plan/`` may not
import.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import yaml

from ndparallel.axolotl import load_config
from ndparallel.config.fields import FSDPConfig
from ndparallel.config.plan_settings import plan_settings
from ndparallel.config.schema import TrainConfig
from ndparallel.layout.config import ParallelismConfigError
from ndparallel.plan.adapters.lora_cost import saved_tables
from ndparallel.plan.cli.main import flag_defaults
from ndparallel.plan.cli.parser import checkpointing_default

RUN_KEYS = (
    "base_model",
    "sequence_len",
    "optimizer",
    "bf16",
    "fp16",
    "adapter",
    *(name for name in TrainConfig.model_fields if name.startswith("lora_")),
    "load_in_4bit",
    "qat",
)
"""The keys of the plan's config (``plan/cli/report.py``'s ``train_config``) that restate the run it was
asked for, in the plan's words (``adamw_torch`` for ``adamw_torch_fused``, ``bf16: true`` for
``bf16: auto``): the merge keeps the source's (the adapter's: ``adapter``, ``load_in_4bit`` and
every ``lora_*`` key of the training config). Every other key is the plan's choice (the layout, the
batch split and the options that go with the layout) and replaces the source's."""


def split_config_arg(argv: list[str]) -> tuple[str | None, list[str]]:
    """(the ``--config`` value, the other arguments)."""
    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    pre.add_argument("--config")
    known, rest = pre.parse_known_args(argv)
    return known.config, rest


def config_defaults(path: str, argv: list[str]) -> tuple[dict, str]:
    """The planner parser's defaults (argument name -> typed value) from training config ``path``
    and a one-line description of what was taken. ``argv`` (the user's flags) gives ``--gpus``.
    Raises ``ValueError`` with the fix."""

    cfg = load_config(path)
    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)  # bad values: the planner says
    for name in ("--gpus", "--global-batch-size", "--global-batch-tokens", "--adapter"):
        pre.add_argument(name)
    given, _ = pre.parse_known_args(argv)
    gpus = int(given.gpus) if given.gpus and given.gpus.isdigit() and int(given.gpus) > 0 else None
    s = plan_settings(cfg)
    defaults = {"model": cfg.base_model, **flag_defaults(s), **checkpointing_default(s)}
    if "cp_comm_strategy" in cfg.model_fields_set:  # named in the config: --max-seq-len keeps it
        defaults["cp_strategy_given"] = True
    if cfg.adapter and given.adapter in (None, "lora", "qlora"):
        defaults["adapter"] = "qlora" if cfg.load_in_4bit else "lora"
        defaults.update(flag_defaults(s, "adapter"))  # the rank: the config's
        if saved_tables(cfg.lora_modules_to_save):
            defaults["lora_modules_to_save"] = ",".join(cfg.lora_modules_to_save)
    said = f"model {cfg.base_model}, seq {cfg.sequence_len}"
    if gpus and not (given.global_batch_size or given.global_batch_tokens):
        dp, where = _config_dp(cfg.parallelism_config(), gpus, path)
        batch = cfg.micro_batch_size * cfg.gradient_accumulation_steps * dp
        defaults["global_batch_size"] = batch
        said += (
            f", global batch {batch} sequences (micro {cfg.micro_batch_size} × accumulation "
            f"{cfg.gradient_accumulation_steps} × dp {dp}{where})"
        )
    return defaults, f"ndparallel plan: from {path}: {said}"


def _config_dp(layout, gpus: int, path: str) -> tuple[int, str]:
    """The data-parallel degree the config trains with: at ``gpus`` ranks when its layout fits
    them, else at its own world size (fixed degrees: the run as configured keeps its batch)."""

    try:
        pc = layout.resolve(gpus)
        return pc.dp_replicate_size * pc.dp_shard_size, ""
    except ParallelismConfigError as e:
        sizes = layout.to_dict().values()
        if -1 in sizes:
            raise ValueError(
                f"--config {path}: its layout does not fit --gpus {gpus} ({e}); give the batch "
                "to keep with --global-batch-size N (sequences per step)"
            ) from None
        own = 1
        for v in sizes:
            own *= v
        pc = layout.resolve(own)
        return pc.dp_replicate_size * pc.dp_shard_size, f" of its own {own}-rank layout"


def merge_written_config(source: str, written: str) -> None:
    """Rewrite ``written`` (the plan's YAML) as ``source`` with the plan's layout and batch fields."""
    plan_text = Path(written).read_text()
    header = "".join(line + "\n" for line in plan_text.splitlines() if line.startswith("#"))
    planned = yaml.safe_load(plan_text) or {}
    merged = yaml.safe_load(Path(source).read_text()) or {}
    if "pipeline_parallel_size" not in planned:  # the plan has no pipeline: drop the source's
        for key in [k for k in merged if k.startswith("pipeline_")]:
            merged.pop(key)
    fsdp = {**(merged.get("fsdp_config") or {}), **planned.pop("fsdp_config", {})}  # all the plan's
    merged.update({key: value for key, value in planned.items() if key not in RUN_KEYS})
    merged["fsdp_config"] = FSDPConfig.runnable(fsdp)
    with open(written, "w") as fh:
        fh.write(header + f"# The rest as in {source}.\n")
        yaml.safe_dump(merged, fh, sort_keys=False)
