"""A first look at each local dataset file before any rank starts: the head of every file (at most
``SAMPLE_BYTES``) is read and checked, so the usual mistakes end in one line naming the file (and
line) instead of a traceback on every rank after minutes of start-up:

* an empty file, or one with no record;
* binary data in a text / JSON / CSV file (a NUL byte or invalid UTF-8), a parquet file that is
  not parquet;
* a JSON-lines line that is not JSON, or not an object (file and line named);
* an unknown ``type``; a column the type needs (``text_field`` for raw text; ``instruction`` and
  ``output`` for alpaca; ``messages``/``conversations`` for chat_template; ``segments`` for
  input_output) in none of the sampled records / not in the CSV header or the parquet schema;
  ``text_field`` other than ``text`` on a plain-text file.

The whole dataset is then tokenized before launch too (``preflight.local.prepare_data``): a bad
record anywhere, or nothing left after filtering, is also found before any rank starts.

Only the head is read here (a 10 GB file costs one MiB); a bad line further down is found by the
tokenising pass before launch, which names its file, line and column (``data/lines.py``). Compressed files are
only checked to exist. A directory: its first ``MAX_FILES`` files are checked.
"""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .corpus import BUILTIN_STDLIB
from .dataset import _COMPRESSION, DatasetSpec, check_type, local_files, looks_local
from .prompts import required_columns

Columns = list[tuple[str, ...]]  # needed columns, each as its alternatives

SAMPLE_BYTES = 1 << 20
MAX_FILES = 256
MAX_JSON_DOCUMENT = 64 << 20  # a .json file holding one array is parsed whole up to this size


def check_dataset(spec: DatasetSpec | Mapping[str, Any], where: str) -> None:
    """``ValueError`` (one line naming ``where``, the file and the fix) for a local dataset whose
    files do not look loadable; Hub names and the built-in corpus pass (checked when loaded)."""
    spec = DatasetSpec.from_any(spec, where)
    check_type(spec, where)
    if spec.path == BUILTIN_STDLIB:
        if not spec.raw:
            raise ValueError(f"{where}: {BUILTIN_STDLIB} is raw text; type {spec.type!r} needs records")
        return
    path = Path(spec.path).expanduser()
    if not path.exists():
        if looks_local(spec.path):
            raise ValueError(
                f"{where}.path={spec.path!r} does not exist: fix the path (relative paths are "
                "taken from the current directory)"
            )
        return  # a Hub dataset name
    files, fmt = local_files(spec, where)
    for f in files[:MAX_FILES]:
        check_file(Path(f), fmt, spec.text_field, where, required_columns(spec))


def check_file(file: Path, fmt: str, text_field: str, where: str, columns: Columns | None = None) -> None:
    """Check the head of one file of format ``fmt`` (text, json, csv, parquet); ``columns``: what
    the dataset type needs (default: ``text_field``)."""
    columns = columns or [(text_field,)]
    if file.name.lower().endswith(_COMPRESSION):
        return
    size = file.stat().st_size
    if size == 0:
        raise ValueError(f"{where}: {file} is empty; remove it from datasets or fill it")
    if fmt == "parquet":
        return _check_parquet(file, columns, where, text_field)
    with open(file, "rb") as f:
        head = f.read(SAMPLE_BYTES)
    whole = len(head) == size
    text = _decode(head, whole, file, where)
    if fmt == "text":
        if text_field != "text":
            raise ValueError(
                f"{where}.text_field={text_field!r}: a plain-text file ({file.name}) gives one "
                "column, 'text'; remove text_field or set it to 'text'"
            )
        if whole and not text.strip():
            raise ValueError(f"{where}: {file} holds only whitespace; remove it from datasets or fill it")
    elif fmt == "json":
        _check_json(text, whole, size, file, columns, where, text_field)
    elif fmt == "csv":
        _check_csv(text, file, columns, where, text_field)


def _decode(head: bytes, whole: bool, file: Path, where: str) -> str:
    nul = head.find(b"\x00")
    if nul >= 0:
        raise ValueError(
            f"{where}: {file} is binary, not text (a NUL byte at offset {nul}); give a "
            "text/JSON/CSV file, or set type to its real format"
        )
    try:
        return head.decode("utf-8")
    except UnicodeDecodeError as e:
        if not whole and e.start >= len(head) - 3:  # a character cut by the sample's end
            return head[: e.start].decode("utf-8")
        raise ValueError(
            f"{where}: {file} is binary or not UTF-8 (invalid byte at offset {e.start}); "
            "give a UTF-8 text file, or set type to its real format"
        ) from None


def _missing_column(columns: Columns, present, file: Path, where: str, text_field: str = "text") -> None:
    """``ValueError`` for the first needed column absent from ``present``."""
    present = list(present)
    for alternatives in columns:
        if not any(c in present for c in alternatives):
            names = " or ".join(repr(c) for c in alternatives)
            field = ".text_field" if alternatives == (text_field,) else ""
            fix = (
                "set text_field to the column holding the text"
                if field
                else "give records with it (see docs/data.md for each type's columns)"
            )
            raise ValueError(
                f"{where}{field}: column {names} is not in {file} (its columns: {sorted(present)[:10]}); "
                f"{fix}"
            )


def _check_json(
    text: str, whole: bool, size: int, file: Path, columns: Columns, where: str, text_field: str
) -> None:
    stripped = text.lstrip()
    if stripped.startswith("["):  # one JSON document: an array of records
        if size > MAX_JSON_DOCUMENT:
            return
        try:
            records = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(
                f"{where}: {file} line {e.lineno}: not valid JSON ({e.msg}, column {e.colno})"
            ) from None
        if not records:
            raise ValueError(f"{where}: {file} holds an empty JSON array: no records")
        keys = {k for r in records[:1000] if isinstance(r, dict) for k in r}
        return _missing_column(columns, keys, file, where, text_field)
    lines = text.splitlines()
    if not whole and lines:
        lines = lines[:-1]  # the sample may end mid-line
    keys: set[str] = set()
    records = 0
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(
                f"{where}: {file} line {number}: not valid JSON ({e.msg}, column {e.colno}); each "
                'line must be one JSON object, e.g. {"text": "..."}'
            ) from None
        if not isinstance(record, dict):
            raise ValueError(
                f"{where}: {file} line {number}: a JSON {type(record).__name__}, not an object; each "
                'line must be one JSON object, e.g. {"text": "..."}'
            )
        records += 1
        keys.update(record)
    if records == 0:
        raise ValueError(f"{where}: {file} holds no records (only blank lines)")
    _missing_column(columns, keys, file, where, text_field)


def _check_csv(text: str, file: Path, columns: Columns, where: str, text_field: str) -> None:
    header = next(csv.reader(io.StringIO(text)), [])
    if not header:
        raise ValueError(f"{where}: {file} has no header line")
    _missing_column(columns, header, file, where, text_field)


def _check_parquet(file: Path, columns: Columns, where: str, text_field: str) -> None:
    import pyarrow.parquet as pq

    with open(file, "rb") as f:
        magic = f.read(4)
    try:
        if magic != b"PAR1":
            raise ValueError("no PAR1 magic")
        names = pq.read_schema(file).names
    except Exception as e:  # noqa: BLE001 - any unreadable footer
        raise ValueError(
            f"{where}: {file} is not a parquet file ({e}); set type to its real format"
        ) from None
    _missing_column(columns, names, file, where, text_field)
