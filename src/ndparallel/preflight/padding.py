"""``--dry-run``'s padding line: the share of the tokens a run computes that are padding, under
its settings (``pad_to_sequence_len``, ``sample_packing``, micro-batch, dp ranks, the layout's
width multiple and buckets: ``training.components.row_widths``), estimated on each dataset's first
``SAMPLE_RECORDS`` records prepared as ``train`` prepares them (in memory, nothing cached) and
drawn by the run's own loader. Only JSON-lines files on this machine are read (their first lines:
a dry run stays quick whatever the data's size); otherwise it says where to look. Throughput is
logged in real tokens; this says how many more the ranks will compute.

The same sample gives ``plan --config`` the length it plans at (``planned_row_length``) and the
run's own loader gives ``simulate`` its (``loader_row_length``): the width the run computes."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ndparallel.config import TrainConfig
from ndparallel.data import PackedLoader
from ndparallel.data.dataset import DatasetSpec, local_files
from ndparallel.data.prepare import build_rows, concatenates
from ndparallel.data.widths import MICRO_BATCHES_READ, padded_fraction, width_quantile
from ndparallel.models.presets import is_preset
from ndparallel.preflight.local import quiet_datasets
from ndparallel.training.components import data_cache_dir, load_tokenizer, row_widths, rows_loader

SAMPLE_RECORDS = 2000


def expected_padding(cfg: TrainConfig, dims, tokenizer) -> str:
    """One line: the expected padded fraction, and what it is computed on."""
    specs = _specs(cfg)
    if concatenates(specs, cfg.sample_packing):
        return "none: raw text is concatenated into full blocks"
    loader = _sample_loader(cfg, specs, dims, tokenizer)
    if isinstance(loader, str):
        return f"not estimated here ({loader})"
    widths = row_widths(cfg, dims)
    shape = (
        f"rows of {cfg.sequence_len}"
        if widths.multiple is None
        else f"each micro-batch cut after its longest row (multiple of {widths.multiple}"
        + (f", buckets {list(widths.buckets)})" if widths.buckets else ")")
    )
    fraction = padded_fraction(loader)
    return (
        f"{fraction:.0%} of the computed tokens expected to be padding ({shape}; estimated on the "
        f"first {SAMPLE_RECORDS} records of each dataset); tok/s counts the real ones"
    )


@dataclass(frozen=True)
class RowLength:
    """The sequence length a run's memory and time are planned at, and the line that says why:
    ``sequence_len`` where rows are padded, packed or concatenated to it; where each micro-batch is
    cut after its longest row, the width 95 % of the micro-batches are computed at or under
    (``data/widths.py``'s ``width_quantile``: rounded and bucketed as ``train`` cuts them)."""

    tokens: int
    text: str
    dynamic: bool = False

    def to_dict(self) -> dict:
        """``plan --json``'s ``rows``."""
        return {"planned_at": self.tokens, "dynamic": self.dynamic, "said": self.text}


def planned_row_length(cfg: TrainConfig, dims) -> RowLength:
    """``plan --config``'s length, from the first ``SAMPLE_RECORDS`` records of each dataset as
    the ``--dry-run`` padding line reads them, with the run's tokenizer where it is on this machine
    (else ``sequence_len``, an upper bound); ``dims``: the config's layout (its width multiple)."""
    specs = None if cfg.pretraining_dataset is not None else _specs(cfg)
    if not _cut(cfg, specs, dims):
        return _full(cfg, specs)
    loader = local_tokenizer(cfg)
    if not isinstance(loader, str):
        try:
            with quiet_datasets():  # one rank's micro-batches: the widths do not depend on dp
                loader = _sample_loader(cfg, specs, dims, loader, dp=1)
        except (ValueError, OSError, KeyError, TypeError) as e:  # the data's own: train says it
            loader = f"the data does not prepare: {' '.join(str(e).split())[:200]}"
    if isinstance(loader, str):
        return RowLength(
            cfg.sequence_len,
            f"rows: dynamic, not estimated here ({loader}): memory and time at sequence_len "
            f"{cfg.sequence_len}, an upper bound",
            dynamic=True,
        )
    paths = ", ".join(str(d.path) for d in cfg.datasets)
    return _dynamic(cfg, loader, f"the first {SAMPLE_RECORDS} records of {paths}")


def loader_row_length(cfg: TrainConfig, loader) -> RowLength:
    """``simulate``'s length, over the run's own prepared data (``loader``: the trainer's)."""
    if not isinstance(loader, PackedLoader) or not loader.pad_to_multiple:
        return _full(cfg, None if cfg.pretraining_dataset is not None else _specs(cfg))
    return _dynamic(cfg, loader, "the prepared data")


def _dynamic(cfg: TrainConfig, loader: PackedLoader, source: str) -> RowLength:
    every = loader.with_dp(0, 1)  # every rank's micro-batches (B rows each), not one rank's share
    width = width_quantile(every)
    buckets = f", buckets {list(loader.buckets)}" if loader.buckets else ""
    return RowLength(
        width,
        f"rows: dynamic, p95 {width} tokens of sequence_len {cfg.sequence_len} (each micro-batch cut "
        f"after its longest row, multiple of {loader.pad_to_multiple}{buckets}; over "
        f"{min(len(every), MICRO_BATCHES_READ)} "
        f"micro-batches of {source}): memory and time at {width}",
        dynamic=True,
    )


def _full(cfg: TrainConfig, specs) -> RowLength:
    if specs is None:
        how = "full blocks of the streamed pretraining_dataset"
    elif concatenates(specs, cfg.sample_packing):
        how = "full blocks of concatenated text"
    elif cfg.sample_packing:
        how = "samples packed into rows padded to it"
    else:
        how = "every row padded to it: pad_to_sequence_len"
    n = cfg.sequence_len
    return RowLength(n, f"rows: sequence_len {n} ({how}): memory and time at {n}")


def _cut(cfg: TrainConfig, specs, dims) -> bool:
    """Are the run's micro-batches cut after their longest row?"""
    if specs is None or concatenates(specs, cfg.sample_packing):
        return False
    return row_widths(cfg, dims).multiple is not None


def _specs(cfg: TrainConfig) -> list[DatasetSpec]:
    return [DatasetSpec.from_any(d.model_dump(), f"datasets[{i}]") for i, d in enumerate(cfg.datasets)]


def _sample_loader(cfg: TrainConfig, specs, dims, tokenizer, dp: int | None = None) -> PackedLoader | str:
    """The run's loader (``dp`` ranks: the layout's by default) over the rows of each dataset's
    first ``SAMPLE_RECORDS`` records, prepared as ``train`` prepares them; else why there is none
    (a phrase)."""
    given = [_first_records(spec) for spec in specs]
    if any(g is None for g in given):
        return "a dataset that is not a local JSON-lines file"
    rows = build_rows(specs, tokenizer, cfg.data_options(), given=given)
    dp = dims.dp if dp is None else dp
    if len(rows) < cfg.micro_batch_size * dp:
        return f"the first {SAMPLE_RECORDS} records make fewer rows than one global micro-batch"
    try:
        return rows_loader(cfg, rows, tokenizer, 0, dp, row_widths(cfg, dims))
    except ValueError:  # multipack: too few packed rows
        return f"the first {SAMPLE_RECORDS} records make fewer rows than one global micro-batch"


def local_tokenizer(cfg: TrainConfig):
    """The run's tokenizer where it is a local directory (a dry run downloads and trains nothing);
    else the reason it is not loaded, as a string."""
    source = cfg.tokenizer or cfg.base_model
    if source == cfg.base_model and is_preset(source):
        return "the built-in tokenizer of a preset model is trained when the run starts"
    if not Path(str(source)).expanduser().is_dir():
        return f"the tokenizer ({source}) is not a local directory"
    try:
        return load_tokenizer(cfg, data_cache_dir(cfg))
    except (ValueError, OSError) as e:
        return f"the tokenizer does not load: {' '.join(str(e).split())[:200]}"


def _first_records(spec: DatasetSpec):
    """The first ``SAMPLE_RECORDS`` records of a local JSON-lines dataset (``datasets.Dataset``),
    else None."""
    import datasets

    if not Path(spec.path).expanduser().exists():
        return None
    files, fmt = local_files(spec, "dataset")
    if fmt != "json" or not files or not str(files[0]).endswith((".jsonl", ".json")):
        return None
    records = []
    with open(files[0], encoding="utf-8") as f:
        for line in f:
            if line.strip():
                if not line.lstrip().startswith("{"):
                    return None  # a JSON array: not read line by line
                records.append(json.loads(line))
            if len(records) == SAMPLE_RECORDS:
                break
    return datasets.Dataset.from_list(records) if records else None
