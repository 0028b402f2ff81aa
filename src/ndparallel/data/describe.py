"""What each ``datasets:`` entry will be read as, in one line (``--dry-run``, ``preprocess``): the
file format and where it came from (``ds_type``, ``type`` spelled as a format, or the extension),
and what the type trains. Reads no data: a path missing here is said to be missing, not refused
(a dry run may describe a run for another machine)."""

from __future__ import annotations

from pathlib import Path

from .corpus import BUILTIN_STDLIB
from .dataset import FORMATS, DatasetSpec, local_files, looks_local

FORMAT_WORDS = {
    "text": "plain text",
    "json": "JSON records",
    "parquet": "Parquet records",
    "csv": "CSV records",
}


def read_as(spec: DatasetSpec, where: str, train_on_inputs: bool = False) -> str:
    """``datasets[0]: data.jsonl read as JSON records (from the extension); alpaca: prompt masked, ...``"""
    return f"{where}: {_source(spec, where)}; {_trains(spec, train_on_inputs)}"


def _source(spec: DatasetSpec, where: str) -> str:
    if spec.path == BUILTIN_STDLIB:
        return f"{BUILTIN_STDLIB}: the Python standard library's source files, plain text"
    if not looks_local(spec.path) and not Path(spec.path).expanduser().exists():
        return f"Hub dataset {spec.path!r} (split {spec.split}{f', config {spec.name}' if spec.name else ''})"
    path = Path(spec.path).expanduser()
    if not path.exists():
        return f"{spec.path} (not on this machine: its format is checked where it runs)"
    try:
        files, fmt = local_files(spec, where)
    except ValueError as e:  # train refuses it before launch with this line
        return f"refused by train: {e}"
    origin = (
        "ds_type"
        if spec.ds_type
        else "type"
        if spec.type in FORMATS
        else "the extension"
        if len(files) == 1
        else "the files' extensions"
    )
    what = path.name if len(files) == 1 and path.is_file() else f"{spec.path} ({len(files)} files)"
    return f"{what} read as {FORMAT_WORDS.get(fmt, fmt)} (from {origin})"


def _trains(spec: DatasetSpec, train_on_inputs: bool) -> str:
    if spec.raw:
        column = "" if spec.path == BUILTIN_STDLIB else f" (column {spec.text_field!r} of records)"
        return f"type {spec.type or 'text'}: raw text, every token trained{column}"
    if spec.format is not None:
        kind = "custom format"
    else:
        kind = spec.type
    if train_on_inputs:
        return f"{kind}: every token trained (train_on_inputs)"
    if spec.base_type == "chat_template":
        return f"{kind}: messages of roles {list(spec.roles_to_train)} trained, the others masked"
    if spec.base_type == "input_output":
        return f"{kind}: segments with label true trained, the others masked"
    return f"{kind}: prompt masked, response trained"
