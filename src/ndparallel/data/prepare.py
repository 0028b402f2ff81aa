"""Dataset specs -> trainable rows: the one entry point (``ndparallel train``, ``preprocess``).

Two ways to make rows of ``sequence_len`` tokens:

* **concatenate** (only raw-text datasets other than ``type: completion``, and ``sample_packing``
  unset; ``packing.build_blocks``):
  every document ends with eos and all are concatenated and cut into blocks, attention running
  across documents: the pre-training practice, and what the built-in quickstart uses.
* **samples** (any fine-tuning type, or ``sample_packing`` set): each record is one sample with
  its own labels (``prompts``/``chat`` -> ``encode``), fitted to a row (``samples``), and
  ``sample_packing: true`` packs several per row by first-fit-decreasing (``bins``),
  ``position_ids`` restarting at each sample so attention never crosses samples; ``false``
  gives one sample per row (so does ``multipack``: the loader packs each epoch, ``multipack``).
  Rows are padded to ``sequence_len`` (``rows.RowStore``). With
  ``shuffle_merged`` the samples are first put in Axolotl's order (``merged_order``).

Every stage is cached in ``cache_dir`` (tokenized samples in ``sft/``, rows in ``rows/``) under
keys of everything that changes them, written once under a file lock; a rank that finds the rows
cached reads no sample.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from filelock import FileLock

from .bins import first_fit_decreasing, next_fit
from .dataset import DatasetSpec, check_text_column, load_records
from .encode import tokenize_samples
from .merged_order import merged_order
from .packing import PackedSplits, build_blocks, split_blocks
from .prompts import required_columns
from .rows import RowStore, write_rows
from .samples import SelectionStats, TokenTable, first_occurrences, select_samples

_ROWS_VERSION = 1


@dataclass(frozen=True)
class DataOptions:
    """The run's data settings (``TrainConfig`` fields of the same names)."""

    sequence_len: int
    sample_packing: bool | None = None
    train_on_inputs: bool = False
    excess_length_strategy: str = "drop"
    chat_template: str | None = None  # the run's default for chat_template datasets
    chat_template_jinja: str | None = None  # the run's Jinja template (chat_template: jinja)
    chat_template_kwargs: dict | None = None  # extra variables of the chat template
    min_sample_len: int | None = None  # fine-tuning samples shorter than this are dropped
    eot_tokens: tuple[str, ...] | None = None  # end-of-turn tokens of chat templates (None: detected)
    val_set_size: float | int = 0
    seed: int = 0
    num_proc: int | None = None
    deduplicate: bool = False  # drop samples repeating an earlier one's tokens and labels
    sequential_packing: bool = False  # sample_packing by next fit in dataset order
    multipack: bool = False  # sample_packing each epoch by the loader (multipack.py): one sample a row here
    boundary_targets: bool = (
        False  # sample_packing: a sample's last token predicts the next's first (Axolotl)
    )
    shuffle_merged: bool = False  # samples in Axolotl's shuffled merged order (merged_order.py)


def concatenates(specs: Iterable[DatasetSpec], sample_packing: bool | None) -> bool:
    """Whether the run uses the concatenate-and-cut blocks rather than whole samples: raw text files
    and the built-in corpus with ``sample_packing`` unset. ``type: completion`` is Axolotl's: each
    document cut into its own ``sequence_len`` pieces, one per padded row (no attention across
    documents)."""
    specs = list(specs)
    return sample_packing is None and all(s.raw and s.type != "completion" for s in specs)


@dataclass
class PreparedSamples:
    """Tokenized datasets and the samples chosen for rows (``select_samples``)."""

    tables: list[TokenTable]
    samples: np.ndarray  # [n, 4]: table, row, start, end
    stats: SelectionStats
    keys: list[str] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.samples)

    def sample(self, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Sample ``k``'s ``input_ids`` and (unshifted) ``labels``, as it goes into a row."""
        table, row, start, end = (int(v) for v in self.samples[k])
        ids, labels = self.tables[table].get(row)
        return ids[start:end], labels[start:end]


def tokenize_specs(
    specs: list[DatasetSpec], tokenizer, options: DataOptions, cache_dir, given: list | None = None
) -> list:
    """Every spec loaded and tokenized (cached) as ``{input_ids, labels}`` datasets; ``given``:
    each spec's records (``datasets.Dataset``s, e.g. a file's first lines) instead of loading them
    (with no ``cache_dir``: nothing is cached)."""
    out = []
    for i, spec in enumerate(specs):
        where = f"datasets[{i}]"
        records = given[i] if given is not None else load_records(spec, cache_dir, where)
        missing = [
            alts for alts in required_columns(spec) if not any(a in records.column_names for a in alts)
        ]
        if missing:
            names = " or ".join(repr(a) for a in missing[0])
            raise ValueError(
                f"{where}: type {spec.type or 'completion'} needs column {names}; {spec.path!r} has "
                f"{records.column_names[:10]}"
            )
        if spec.raw:
            check_text_column(records, spec, where)
        out.append(
            tokenize_samples(
                records,
                spec,
                tokenizer,
                where=where,
                train_on_inputs=options.train_on_inputs,
                chat_template=options.chat_template,
                eot_tokens=options.eot_tokens,
                cache_dir=cache_dir,
                num_proc=options.num_proc,
                chat_template_jinja=options.chat_template_jinja,
                template_kwargs=options.chat_template_kwargs,
            )
        )
    return out


def prepare_samples(
    specs: list[DatasetSpec], tokenizer, options: DataOptions, cache_dir=None, tokenized: list | None = None
) -> PreparedSamples:
    """Tokenize and choose the samples; ``ValueError`` when none is left."""
    tokenized = tokenized if tokenized is not None else tokenize_specs(specs, tokenizer, options, cache_dir)
    tables = [TokenTable(t) for t in tokenized]
    samples, stats = select_samples(
        tables,
        [s.raw for s in specs],
        options.sequence_len,
        options.excess_length_strategy,
        options.min_sample_len,
    )
    if options.shuffle_merged:  # before deduplication: Axolotl keeps the first in its shuffled order
        samples = samples[
            merged_order(tables, [s.raw for s in specs], samples, options.sequence_len, options.seed)
        ]
    if options.deduplicate:
        unique = first_occurrences(tables, samples)
        stats.dropped_duplicates, stats.samples = len(samples) - len(unique), len(unique)
        samples = unique
    if len(samples) == 0:
        raise ValueError(
            f"datasets: no sample left to train on ({stats.records} records; "
            f"{stats.dropped_too_long} longer than sequence_len={options.sequence_len} dropped, "
            f"{stats.dropped_too_short} shorter than min_sample_len dropped, "
            f"{stats.dropped_untrained} with no trained token); check the data, raise sequence_len, "
            "or set excess_length_strategy: truncate"
        )
    return PreparedSamples(tables, samples, stats, [t._fingerprint for t in tokenized])


def build_rows(
    specs: list[DatasetSpec], tokenizer, options: DataOptions, cache_dir=None, given: list | None = None
) -> RowStore:
    """Rows of whole samples (packed when ``sample_packing``), cached in ``cache_dir/rows/<key>/``;
    of ``given`` records (``tokenize_specs``), in memory and uncached (an estimate's sample)."""
    if given is not None:
        tokenized = tokenize_specs(specs, tokenizer, options, None, given)
        return _write(specs, tokenizer, options, tokenized, row_pad_id(tokenizer), None)
    tokenized = tokenize_specs(specs, tokenizer, options, cache_dir)
    pad_id = row_pad_id(tokenizer)
    settings = [
        _ROWS_VERSION,
        [t._fingerprint for t in tokenized],
        [s.raw for s in specs],
        options.sequence_len,
        bool(options.sample_packing),
        options.excess_length_strategy,
        pad_id,
        options.min_sample_len,
        *(
            [options.deduplicate, options.sequential_packing]
            if options.deduplicate or options.sequential_packing
            else []
        ),
        *([tokenizer.bos_token_id] if options.boundary_targets and options.sample_packing else []),
        *(["shuffle_merged", options.seed] if options.shuffle_merged else []),
        *(["multipack"] if options.multipack and options.sample_packing else []),
    ]  # keys of older caches stay valid
    key = hashlib.sha256(json.dumps(settings).encode()).hexdigest()[:32]
    directory = None if cache_dir is None else Path(cache_dir) / "rows" / key
    if directory is not None:
        directory.parent.mkdir(parents=True, exist_ok=True)
        with FileLock(str(directory) + ".lock"):
            if (directory / "meta.json").is_file():
                return RowStore.open(directory)
            return _write(specs, tokenizer, options, tokenized, pad_id, directory)
    return _write(specs, tokenizer, options, tokenized, pad_id, None)


def _write(
    specs, tokenizer, options: DataOptions, tokenized, pad_id: int, directory: Path | None
) -> RowStore:
    prepared = prepare_samples(specs, tokenizer, options, tokenized=tokenized)
    lengths = prepared.samples[:, 3] - prepared.samples[:, 2]
    if options.sample_packing and not options.multipack:
        pack = next_fit if options.sequential_packing else first_fit_decreasing
        row_of = pack(lengths, options.sequence_len)
    else:
        row_of = np.arange(len(lengths), dtype=np.int64)
    n_rows = int(row_of.max()) + 1
    meta = {
        "rows": n_rows,
        "sequence_len": options.sequence_len,
        "sample_packing": bool(options.sample_packing),
        "tokens": int(lengths.sum()),
        "fill": float(lengths.sum() / (n_rows * options.sequence_len)),
        **prepared.stats.as_dict(),
    }
    boundary = tokenizer.bos_token_id if options.boundary_targets and options.sample_packing else None
    return write_rows(
        prepared.tables,
        prepared.samples,
        row_of,
        options.sequence_len,
        pad_id,
        directory,
        meta,
        boundary_targets=boundary,
    )


def row_pad_id(tokenizer) -> int:
    """The token that pads rows: the tokenizer's pad, else eos, else 0."""
    for value in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if value is not None:
            return int(value)
    return 0


def build_data(
    specs: Iterable[DatasetSpec | Mapping[str, Any] | str],
    tokenizer,
    options: DataOptions,
    cache_dir: str | os.PathLike | None = None,
) -> PackedSplits:
    """Train (and validation) rows for ``specs``: concatenated blocks or whole samples (see above)."""
    specs = [DatasetSpec.from_any(s, f"datasets[{i}]") for i, s in enumerate(specs)]
    if concatenates(specs, options.sample_packing):
        return build_blocks(
            specs,
            tokenizer,
            options.sequence_len,
            val_set_size=options.val_set_size,
            seed=options.seed,
            cache_dir=cache_dir,
            num_proc=options.num_proc,
        )
    store = build_rows(specs, tokenizer, options, cache_dir)
    train, val = split_blocks(store, options.val_set_size, options.seed)
    return PackedSplits(train, val)
