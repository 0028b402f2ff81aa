"""Where a bad record is in its file: ``first_bad_line`` names the file, line and column.

The datasets loader parses every line of every local file (one pass, in C) and the tokenising
pass reads every record; neither says *where* a bad one is. When either fails, this scans the
files again in Python, in order, up to the first line that is not a usable record: not JSON, not
an object, a needed column missing or null, raw text that is not a string, invalid UTF-8 or a
NUL byte in a plain-text or CSV file. It runs only on a failure, so a good dataset costs no
extra pass. Compressed files are not scanned (the loader's own message is shown).
"""

from __future__ import annotations

import csv
import json
from collections.abc import Iterable
from pathlib import Path

Columns = list[tuple[str, ...]]  # needed columns, each as its alternatives
_JSON_TYPES = {int: "number", float: "number", bool: "boolean", list: "array", str: "string", dict: "object"}
COMPRESSION = (".gz", ".bz2", ".xz", ".zst", ".lz4")
"""Compressed files: read by the datasets loader, not scanned line by line here."""
_EXAMPLE = 'each line must be one JSON object, e.g. {"text": "..."}'


def first_bad_line(
    files: Iterable[str], fmt: str, columns: Columns, text_column: str | None, where: str
) -> str | None:
    """One line naming ``where``, the file, the line (and column) of the first bad record of
    ``files`` (format ``fmt``), or None when every record looks usable. ``columns``: what each
    record needs; ``text_column``: a column that must hold a string (raw text)."""
    for name in files:
        file = Path(name)
        if file.name.lower().endswith(COMPRESSION) or fmt == "parquet":
            continue
        problem = {"json": _json, "csv": _csv, "text": _text}[fmt](file, columns, text_column)
        if problem:
            return f"{where}: {file} {problem}"
    return None


def _record_problem(record, columns: Columns, text_column: str | None) -> str | None:
    if not isinstance(record, dict):
        return f"a JSON {_JSON_TYPES.get(type(record), type(record).__name__)}, not an object; {_EXAMPLE}"
    for alternatives in columns:
        if not any(record.get(c) is not None for c in alternatives):
            names = " or ".join(repr(c) for c in alternatives)
            return f"has no {names} (its keys: {sorted(record)[:10]}); every record needs it"
    value = record.get(text_column) if text_column else ""
    if not isinstance(value, str):
        return (
            f"{text_column!r} is a JSON {_JSON_TYPES.get(type(value), type(value).__name__)}, not text; raw "
            f"text must be a JSON string (set "
            "text_field to the column holding the text)"
        )
    return None


def _json(file: Path, columns: Columns, text_column: str | None) -> str | None:
    with open(file, "rb") as f:
        head = f.read(64).lstrip()
    if head.startswith(b"["):  # one JSON document: an array of records
        try:
            records = json.loads(file.read_text(encoding="utf-8"))
        except UnicodeDecodeError as e:
            return f"is not UTF-8 (invalid byte at offset {e.start})"
        except json.JSONDecodeError as e:
            return f"line {e.lineno}: not valid JSON ({e.msg}, column {e.colno})"
        for k, record in enumerate(records if isinstance(records, list) else [records]):
            problem = _record_problem(record, columns, text_column)
            if problem:
                return f"record {k} (0-based) of the JSON array: {problem}"
        return None
    with open(file, "rb") as f:
        for number, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                return f"line {number}: not UTF-8 (invalid byte at column {e.start + 1})"
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                return f"line {number}: not valid JSON ({e.msg}, column {e.colno}); {_EXAMPLE}"
            problem = _record_problem(record, columns, text_column)
            if problem:
                return f"line {number}: {problem}"
    return None


def _text(file: Path, columns: Columns, text_column: str | None) -> str | None:
    with open(file, "rb") as f:
        for number, raw in enumerate(f, start=1):
            nul = raw.find(b"\x00")
            if nul >= 0:
                return f"line {number}: a NUL byte at column {nul + 1} (binary data, not text)"
            try:
                raw.decode("utf-8")
            except UnicodeDecodeError as e:
                return f"line {number}: not UTF-8 (invalid byte at column {e.start + 1}); give a UTF-8 file"
    return None


def _csv(file: Path, columns: Columns, text_column: str | None) -> str | None:
    problem = _text(file, columns, None)
    if problem:
        return problem
    with open(file, encoding="utf-8", newline="") as f:
        reader = csv.reader(f)
        header = next(reader, [])
        for row in reader:
            if len(row) != len(header) and any(cell.strip() for cell in row):
                return (
                    f"line {reader.line_num}: {len(row)} fields, the header has {len(header)} (quote fields "
                    "holding commas or newlines)"
                )
            if text_column in header and not row[header.index(text_column)]:
                return f"line {reader.line_num}: {text_column!r} is empty (every record needs its text)"
    return None


def text_column_problem(ds, spec, files: list[str] | None, fmt: str | None, where: str) -> str | None:
    """Raw text: every value of ``spec.text_field`` must be a string (a number, a list, a null would
    be trained as something else or dropped without a word). Checked on the Arrow schema and null
    count (no pass over the data); the bad line is then located in ``files``."""
    import datasets

    column = spec.text_field
    feature = ds.features.get(column)
    strings = isinstance(feature, datasets.Value) and feature.dtype in ("string", "large_string")
    if strings and ds.data.column(column).null_count == 0:
        return None
    located = first_bad_line(files, fmt, [(column,)], column, where) if files and fmt else None
    what = "nulls (records without it)" if strings else f"{feature} values"
    return located or (
        f"{where}.text_field: column {column!r} of {spec.path!r} holds {what}, not text only; "
        "every record needs its text as a string"
    )
