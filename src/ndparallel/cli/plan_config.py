"""``ndparallel plan --config TRAIN.yaml``: plan for a training config.

The typed config (``TrainConfig``) gives the run's values by their keys (``config_values``: its
``Settings`` through ``config/plan_settings.py``, its optimizer, adapter and batch), under the flags
given on the command line, which win. The global batch is the config's:
``micro_batch_size × gradient_accumulation_steps × dp`` of its own layout at ``--gpus`` (the planner
then keeps it fixed while it searches layouts and micro-batches). The length planned is the one
``train`` computes: ``sequence_len``, or the p95 width where it cuts each micro-batch after its
longest row (``preflight/padding.py``). With ``--write-config OUT``, OUT
is the user's config with only the layout and batch fields replaced by the plan's choice
(everything else — data, optimizer, LoRA, output_dir — kept).

Lives in ``cli/`` because it reads the training config, which ``plan/`` may not import.
"""

from __future__ import annotations

import math
from pathlib import Path

import yaml

from ndparallel.axolotl import load_config
from ndparallel.config.fields import FSDPConfig
from ndparallel.config.plan_settings import plan_settings
from ndparallel.config.schema import TrainConfig
from ndparallel.layout.config import ParallelismConfigError
from ndparallel.plan.adapters.lora_cost import saved_tables
from ndparallel.plan.cli.flags import FLAGS
from ndparallel.plan.cli.from_flags import SETTINGS
from ndparallel.plan.cli.parser import given
from ndparallel.plan.settings import Settings

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
PINNED_WHERE_SET = ("ac_policy", "activation_offloading", "reshard_after_forward", "tiled_mlp")
"""The searched settings a config pins where it departs from the runtime's default (as its
``activation_checkpointing: true`` pins checkpointing on); at the default the search chooses."""


def config_values(path: str, args) -> tuple[dict, str, object]:
    """The run's values (by key, as ``plan/cli/from_flags.py`` reads them) of training config ``path``,
    the lines that say what was taken, and the row length planned (``preflight/padding.py``'s
    ``RowLength``; None when the command line gives the length); the parsed ``args`` give ``--gpus``
    and the flags that leave the config's batch or adapter out. Raises ``ValueError`` with the fix."""
    cfg = load_config(path)
    s = plan_settings(cfg)
    values = {"base_model": cfg.base_model, "optimizer": cfg.optimizer}
    values.update({f.key: getattr(s, f.key) for f in FLAGS if f.key in SETTINGS})
    if "cp_comm_strategy" not in cfg.model_fields_set:  # not named: --max-seq-len tries each
        values.pop("cp_comm_strategy")
    if s.activation_checkpointing:  # else the search tries both
        values["activation_checkpointing"] = "on"
    for key in PINNED_WHERE_SET:  # the config's own choice pins it; the default is searched
        if getattr(s, key) != getattr(Settings(s.sequence_len), key):
            values[key] = getattr(s, key)
    if cfg.adapter and getattr(args, "adapter", None) in (None, "lora", "qlora"):
        values.update(adapter="qlora" if cfg.load_in_4bit else "lora", lora_r=s.lora_r)
        if saved_tables(cfg.lora_modules_to_save):
            values["lora_modules_to_save"] = cfg.lora_modules_to_save
    said = f"model {cfg.base_model}, seq {cfg.sequence_len}"
    gpus = args.gpus if args.gpus and args.gpus > 0 else None
    batch_given = bool(args.global_batch_size or args.global_batch_tokens)
    pc, where = _config_layout(cfg.parallelism_config(), gpus, path, batch_given)
    if gpus and not batch_given:
        dp = pc.dp_replicate_size * pc.dp_shard_size
        batch = cfg.micro_batch_size * cfg.gradient_accumulation_steps * dp
        values["global_batch_size"] = batch
        said += (
            f", global batch {batch} sequences (micro {cfg.micro_batch_size} × accumulation "
            f"{cfg.gradient_accumulation_steps} × dp {dp}{where})"
        )
    said = f"ndparallel plan: from {path}: {said}"
    if "sequence_len" not in given(args) and not args.max_seq_len:  # the length is the config's
        rows = _row_length(cfg, pc)
        values["sequence_len"] = rows.tokens
        said += f"\nndparallel plan: {rows.text}"
        return values, said, rows
    return values, said, None


def _row_length(cfg: TrainConfig, pc):
    """The length ``train`` computes the config's rows at (``preflight/padding.py``): its
    ``sequence_len``, or where each micro-batch is cut after its longest row, the p95 width of the
    micro-batches over the first records of its local JSON-lines data, rounded for its layout ``pc``."""
    from ndparallel.preflight.padding import planned_row_length

    return planned_row_length(cfg, pc.dims)


def _config_layout(layout, gpus: int | None, path: str, batch_given: bool) -> tuple:
    """The layout the config trains with and a note on it: at ``gpus`` ranks when it fits them,
    else at its own world size (fixed degrees: the run as configured keeps its batch; a ``-1``
    degree at 1: its degrees still round the row widths). A ``-1`` degree that does not fit
    ``gpus`` without the batch on the command line is an error naming the flag."""

    sizes = {k: v for k, v in layout.to_dict().items() if k != "ep_size"}  # ep splits dp × cp
    if gpus is not None:
        try:
            return layout.resolve(gpus), ""
        except ParallelismConfigError as e:
            if -1 in sizes.values() and not batch_given:
                raise ValueError(
                    f"--config {path}: its layout does not fit --gpus {gpus} ({e}); give the batch "
                    "to keep with --global-batch-size N (sequences per step)"
                ) from None
    own = math.prod(max(v, 1) for v in sizes.values())
    return layout.resolve(own), f" of its own {own}-rank layout"


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
