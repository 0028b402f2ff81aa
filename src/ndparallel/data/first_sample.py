"""The first trained sample of a ``datasets:`` entry, masked part marked (``--dry-run``).

Its first record is read straight from the local file — one line of a JSON-lines file, one row of
a CSV or Parquet file; no dataset is built and nothing is cached — then rendered and tokenised by
the training code itself (``tokenize_samples`` on a one-record dataset), so what is shown is what
the first step of that record will train. Trained tokens are wrapped in ``[[ ]]``, newlines are
shown as ``\\n``; a long sample keeps its start and its end (where the trained answer usually is).
"""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

from ndparallel.data.encode import tokenize_samples

from .dataset import DatasetSpec, local_files, looks_local
from .lines import COMPRESSION

SHOWN_CHARS = (200, 400)
"""Characters kept from the start and the end of a long sample."""
WHOLE_JSON_LIMIT = 64 << 20
"""A JSON array file larger than this is not parsed for its first record (one JSON document)."""


class NotShown(Exception):
    """Why the first sample cannot be shown here (the message says so)."""


def first_record(spec: DatasetSpec, where: str) -> dict[str, Any]:
    """The first record of a local dataset file, or ``NotShown``."""
    if not looks_local(spec.path) and not Path(spec.path).expanduser().exists():
        raise NotShown("a Hub dataset: read where it runs")
    if not Path(spec.path).expanduser().exists():
        raise NotShown(f"{spec.path} is not on this machine")
    files, fmt = local_files(spec, where)
    if not files:
        raise NotShown("no data file")
    file = Path(files[0])
    if file.name.lower().endswith(COMPRESSION):
        raise NotShown(f"{file.name} is compressed: `ndparallel preprocess CONFIG --show 1` shows it")
    record = {"json": _first_json, "csv": _first_csv, "parquet": _first_parquet}.get(fmt, _not_records)(file)
    if not isinstance(record, dict):
        raise NotShown(f"{file.name}: its first record is not an object")
    return record


def _first_json(file: Path) -> Any:
    with open(file, "rb") as f:
        head = f.read(64).lstrip()
        if head.startswith(b"["):
            if file.stat().st_size > WHOLE_JSON_LIMIT:
                raise NotShown(
                    f"{file.name} is one large JSON array: `ndparallel preprocess CONFIG --show 1`"
                )
            records = json.loads(file.read_text(encoding="utf-8"))
            if not records:
                raise NotShown(f"{file.name} holds no record")
            return records[0] if isinstance(records, list) else records
        f.seek(0)
        for line in f:
            if line.strip():
                return json.loads(line)
    raise NotShown(f"{file.name} holds no record")


def _first_csv(file: Path) -> Any:
    with open(file, newline="", encoding="utf-8") as f:
        row = next(csv.DictReader(f), None)
    if row is None:
        raise NotShown(f"{file.name} holds no record")
    return row


def _first_parquet(file: Path) -> Any:
    import pyarrow.parquet as pq

    for batch in pq.ParquetFile(file).iter_batches(batch_size=1):
        rows = batch.to_pylist()
        if rows:
            return rows[0]
    raise NotShown(f"{file.name} holds no record")


def _not_records(file: Path) -> Any:
    raise NotShown(f"{file.name} is plain text: every token is trained")


def first_sample(spec: DatasetSpec, where: str, tokenizer, options) -> str:
    """``N tokens, M trained: <text with [[trained]] runs>`` for the first record of ``spec``
    (``options``: the run's ``DataOptions``); ``NotShown`` where that cannot be done here."""
    import datasets

    if spec.raw:
        raise NotShown("raw text: every token is trained")
    record = first_record(spec, where)
    one = datasets.Dataset.from_list([record])
    row = tokenize_samples(
        one,
        spec,
        tokenizer,
        where=where,
        train_on_inputs=options.train_on_inputs,
        chat_template=options.chat_template,
        eot_tokens=options.eot_tokens,
        chat_template_jinja=options.chat_template_jinja,
        template_kwargs=options.chat_template_kwargs,
    )[0]
    ids, labels = row["input_ids"], row["labels"]
    long = ""
    if len(ids) > options.sequence_len:
        long = f" (longer than sequence_len {options.sequence_len}: {options.excess_length_strategy})"
        if options.excess_length_strategy == "truncate":
            ids, labels = ids[: options.sequence_len], labels[: options.sequence_len]
    trained = sum(label != -100 for label in labels)
    return f"{len(ids)} tokens{long}, {trained} trained: {marked_text(tokenizer, ids, labels)}"


def marked_text(tokenizer, ids: list[int], labels: list[int]) -> str:
    """The decoded tokens, trained runs in ``[[ ]]``, newlines as ``\\n``, long ones shortened."""
    pieces, previous = [], False
    for token, label in zip(ids, labels):
        trained = label != -100
        if trained != previous:
            pieces.append("[[" if trained else "]]")
            previous = trained
        pieces.append(tokenizer.decode([token]))
    if previous:
        pieces.append("]]")
    text = "".join(pieces).replace("\r", "\\r").replace("\n", "\\n")
    start, end = SHOWN_CHARS
    if len(text) > start + end + 20:
        text = f"{text[:start]} … ({len(text) - start - end} characters) … {text[-end:]}"
    return text
