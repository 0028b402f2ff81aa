"""``--dry-run``'s padding line: the share of the tokens a run computes that are padding, under
its settings (``pad_to_sequence_len``, ``sample_packing``, micro-batch, dp ranks, the layout's
width multiple and buckets: ``training.components.row_widths``), estimated on each dataset's first
``SAMPLE_RECORDS`` records prepared as ``train`` prepares them (in memory, nothing cached) and
drawn by the run's own loader. Only JSON-lines files on this machine are read (their first lines:
a dry run stays quick whatever the data's size); otherwise it says where to look. Throughput is
logged in real tokens; this says how many more the ranks will compute."""

from __future__ import annotations

import json
from pathlib import Path

from ndparallel.config import TrainConfig
from ndparallel.data import PackedLoader
from ndparallel.data.dataset import DatasetSpec, local_files
from ndparallel.data.prepare import build_rows, concatenates
from ndparallel.data.widths import padded_fraction
from ndparallel.training.components import row_widths

SAMPLE_RECORDS = 2000


def expected_padding(cfg: TrainConfig, dims, tokenizer) -> str:
    """One line: the expected padded fraction, and what it is computed on."""
    specs = [DatasetSpec.from_any(d.model_dump(), f"datasets[{i}]") for i, d in enumerate(cfg.datasets)]
    if concatenates(specs, cfg.sample_packing):
        return "none: raw text is concatenated into full blocks"
    given = [_first_records(spec) for spec in specs]
    if any(g is None for g in given):
        return "not estimated here (a dataset that is not a local JSON-lines file)"
    rows = build_rows(specs, tokenizer, cfg.data_options(), given=given)
    widths = row_widths(cfg, dims)
    shape = (
        f"rows of {cfg.sequence_len}"
        if widths.multiple is None
        else f"each micro-batch cut after its longest row (multiple of {widths.multiple}"
        + (f", buckets {list(widths.buckets)})" if widths.buckets else ")")
    )
    if len(rows) < cfg.micro_batch_size * dims.dp:
        return (
            f"not estimated: the first {SAMPLE_RECORDS} records make fewer rows than one global micro-batch"
        )
    loader = PackedLoader(
        rows,
        cfg.micro_batch_size,
        dp_size=dims.dp,
        seed=cfg.seed,
        shuffle=not cfg.curriculum_sampling,
        pad_to_multiple=widths.multiple,
        buckets=widths.buckets,
    )
    fraction = padded_fraction(loader)
    return (
        f"{fraction:.0%} of the computed tokens expected to be padding ({shape}; estimated on the "
        f"first {SAMPLE_RECORDS} records of each dataset); tok/s counts the real ones"
    )


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
