"""``ndparallel preprocess CONFIG``: tokenize (and cache) the datasets exactly as ``train`` would,
then print a summary, some samples with their trained tokens highlighted (``--show N``, as
Axolotl's debug view), or every sample as JSON (``--json``: ``input_ids`` and ``labels`` per
line, before packing; -100 = not trained), in the data's order (training draws them in Axolotl's
shuffled order: ``data/merged_order.py``)."""

from __future__ import annotations

import dataclasses
import json
import sys
from typing import TextIO

from ndparallel.config import TrainConfig
from ndparallel.data.check import check_dataset
from ndparallel.data.dataset import DatasetSpec, load_text_datasets, tokenize_dataset
from ndparallel.data.describe import read_as
from ndparallel.data.prepare import concatenates, prepare_samples, tokenize_specs
from ndparallel.preflight.local import quiet_datasets
from ndparallel.training.components import build_data, data_cache_dir, load_tokenizer

TRAINED, MASKED = "bold green", "dim"


def preprocess(
    cfg: TrainConfig, show: int | None = None, as_json: bool = False, out: TextIO | None = None
) -> int:
    """Run the data pipeline of ``cfg`` (cached); returns the number of samples."""

    with quiet_datasets():
        return _preprocess(cfg, show, as_json, out)


def _preprocess(cfg: TrainConfig, show: int | None, as_json: bool, out: TextIO | None) -> int:

    out = out or sys.stdout
    if cfg.missing_data_problem():
        raise ValueError(cfg.missing_data_problem())
    if cfg.pretraining_dataset is not None:
        raise ValueError(
            "pretraining_dataset is streamed while training (nothing is prepared ahead); preprocess "
            "prepares datasets:"
        )
    for i, d in enumerate(cfg.datasets):  # the quick look first: file and line named
        check_dataset(d.model_dump(), f"datasets[{i}]")
    cache = data_cache_dir(cfg)
    tokenizer = load_tokenizer(cfg, cache)
    splits = build_data(cfg, tokenizer, cache)  # what train uses, cached for it
    specs = [DatasetSpec.from_any(d.model_dump(), f"datasets[{i}]") for i, d in enumerate(cfg.datasets)]
    options = dataclasses.replace(cfg.data_options(), shuffle_merged=False)  # shown in the data's order
    if concatenates(specs, cfg.sample_packing):
        samples = _documents(specs, tokenizer, cache)
        summary = (
            f"{len(samples)} documents concatenated into {_rows(splits)} blocks of {cfg.sequence_len + 1} "
            "tokens (raw text, every token trained)"
        )
    else:
        prepared = prepare_samples(
            specs, tokenizer, options, cache, tokenize_specs(specs, tokenizer, options, cache)
        )
        samples = [
            prepared.sample(k) for k in range(len(prepared) if show is None else min(show, len(prepared)))
        ]
        st = prepared.stats
        summary = (
            f"{st.records} records -> {st.samples} samples ({st.truncated} truncated, {st.dropped_too_long} "
            f"dropped as too long, {st.dropped_untrained} with no trained token, {st.pieces_from_split} "
            f"extra "
            f"pieces of long raw text) -> {_rows(splits)} rows of {cfg.sequence_len} tokens"
            + (
                " (one sample per row: multipack packs them each epoch)"
                if cfg.sample_packing and cfg.sample_packing_order == "multipack"
                else " (sample packing)"
                if cfg.sample_packing
                else " (one sample per row)"
            )
        )
    count = len(samples) if show is None else min(show, len(samples))
    if as_json:
        for ids, labels in samples[:count]:
            out.write(
                json.dumps({"input_ids": [int(i) for i in ids], "labels": [int(x) for x in labels]}) + "\n"
            )
        print(f"ndparallel preprocess: {summary}", file=sys.stderr)
        return count
    print(f"ndparallel preprocess: {summary}; cached in {cache}", file=out)

    for i, spec in enumerate(specs):
        print(f"  {read_as(spec, f'datasets[{i}]', bool(cfg.train_on_inputs))}", file=out)
    if show:
        _show(tokenizer, samples[:count], out)
    return count


def _rows(splits) -> int:
    return splits.train.shape[0] + (splits.val.shape[0] if splits.val is not None else 0)


def _documents(specs, tokenizer, cache) -> list:
    """Raw-text documents as (input_ids, labels = input_ids), as the concatenating pipeline makes them."""
    import numpy as np

    ids = tokenize_dataset(load_text_datasets(specs, cache), tokenizer, cache)["input_ids"]
    return [(np.asarray(x), np.asarray(x)) for x in ids]


def _show(tokenizer, samples, out: TextIO) -> None:
    """Each sample's tokens, trained ones highlighted (rich colours on a terminal; elsewhere the
    trained runs are wrapped in [[ ]])."""
    from rich.console import Console
    from rich.text import Text

    console = Console(file=out, highlight=False, soft_wrap=True)
    marks = ("", "") if console.is_terminal else ("[[", "]]")
    console.print(
        Text.assemble(
            "legend: ",
            (f"{marks[0]}trained (label = token){marks[1]}", TRAINED),
            " / ",
            ("masked (-100)", MASKED),
        )
    )
    for k, (ids, labels) in enumerate(samples):
        text = Text(f"--- sample {k}: {len(ids)} tokens, {int((labels != -100).sum())} trained\n")
        previous = False
        for token, label in zip(ids.tolist(), labels.tolist()):
            trained = label != -100
            if trained != previous:
                text.append(marks[0] if trained else marks[1])
            text.append(tokenizer.decode([token]), style=TRAINED if trained else MASKED)
            previous = trained
        text.append(marks[1] if previous else "")
        console.print(text)
