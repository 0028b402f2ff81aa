"""Dataset specs -> one ``{"text"}`` dataset -> tokenized ``{"input_ids"}`` (cached on disk).

A spec is a dict (Axolotl-style YAML ``datasets:`` entry) or a :class:`DatasetSpec`:
``{path, type, split, text_field, ...}``. ``path`` is a local file or directory,
``"builtin:stdlib"`` (the stdlib corpus), or a Hugging Face Hub dataset name (needs network).
``type`` is a file format (``text``, ``json`` for .json/.jsonl, ``parquet``, ``csv``: raw text),
``completion``/``pretrain`` (a raw text column in a file of any format), or a fine-tuning format
(``alpaca``, ``chat_template``, ``input_output``: see ``prompts.py``); the file format is
``ds_type`` or inferred from the extension. Plain-text files give one document per file
(``sample_by="document"``; ``"line"`` and ``"paragraph"`` are the other choices).
"""

from __future__ import annotations

import difflib
import hashlib
import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import datasets
from filelock import FileLock
from transformers import PreTrainedTokenizerBase

from ndparallel.data.lines import first_bad_line, text_column_problem
from ndparallel.runtime.network import reachable

from .corpus import BUILTIN_STDLIB, stdlib_dataset
from .dataset_spec import FORMATS, TYPES, DatasetSpec
from .instruct import USER_DEFINED
from .lines import COMPRESSION as _COMPRESSION


def required_columns(spec: DatasetSpec) -> list[tuple[str, ...]]:
    """Columns a record of ``spec.type`` needs; each entry lists alternatives (any one suffices)."""
    if spec.raw:
        return [(spec.text_field,)]
    if spec.base_type == "alpaca":
        return [("instruction",), ("output",)]
    if spec.format is not None:
        return spec.format.required_columns()
    if spec.type == "input_output":
        return [("segments",)]
    if spec.type == "jeopardy":
        return [("question",), ("category",), ("answer",)]
    return [(spec.field_messages,)] if spec.field_messages else [("messages", "conversations")]


def check_split(spec: DatasetSpec, where: str) -> None:
    """``split`` is Hugging Face's split syntax (``train``, ``train[:20%]``, ``train[10:100]``)."""
    try:
        datasets.ReadInstruction.from_spec(spec.split)
    except (ValueError, AssertionError) as e:
        raise ValueError(
            f"{where}.split: {spec.split!r} is not a split ({e}); write e.g. train, train[:20%] or "
            "train[100:200]"
        ) from None


def check_type(spec: DatasetSpec, where: str) -> None:
    """``ValueError`` for an unknown ``type`` / ``ds_type`` (with a did-you-mean) or ``split``."""
    check_split(spec, where)
    if spec.type == USER_DEFINED and spec.format is None:
        raise ValueError(
            f"{where}.type: {USER_DEFINED} is written as a mapping: type: {{format: "
            "'... {instruction} ...', field_instruction: ..., field_output: ...}"
        )
    if spec.type is not None and spec.type not in TYPES and spec.type != USER_DEFINED:
        close = difflib.get_close_matches(str(spec.type), TYPES, n=1, cutoff=0.6)
        hint = f"did you mean {close[0]!r}? " if close else ""
        if spec.type == "sharegpt":  # Axolotl's old name
            hint = "use chat_template (it reads ShareGPT's from/value messages); "
        raise ValueError(
            f"{where}.type: unknown type {spec.type!r}; {hint}use one of {list(TYPES)} or leave it "
            "out for raw text (format from the file extension)"
        )
    if spec.ds_type is not None and spec.ds_type not in FORMATS:
        raise ValueError(f"{where}.ds_type: unknown file format {spec.ds_type!r}; use one of {list(FORMATS)}")


def load_records(
    spec: DatasetSpec | Mapping[str, Any] | str,
    cache_dir: str | os.PathLike | None = None,
    where: str = "dataset",
) -> datasets.Dataset:
    """Load one spec with all its columns (local files, the built-in corpus or a Hub dataset)."""
    spec = DatasetSpec.from_any(spec, where)
    check_type(spec, where)
    if spec.path == BUILTIN_STDLIB:
        ds = stdlib_dataset(spec.max_files, spec.max_bytes)
    elif os.path.exists(spec.path):
        ds = _load_local(spec, cache_dir, where)
    elif looks_local(spec.path):
        raise ValueError(
            f"{where}.path: {spec.path!r} does not exist (cwd: {os.getcwd()}); fix the path, or use "
            f"{BUILTIN_STDLIB!r} for the built-in corpus"
        )
    else:
        ds = _load_hub(spec, cache_dir, where)
    return ds


def load_text_dataset(
    spec: DatasetSpec | Mapping[str, Any] | str,
    cache_dir: str | os.PathLike | None = None,
    where: str = "dataset",
) -> datasets.Dataset:
    """Load one raw-text spec as a dataset with the single column ``text``."""
    spec = DatasetSpec.from_any(spec, where)
    check_type(spec, where)
    if not spec.raw:
        raise ValueError(f"{where}.type: {spec.type!r} is a fine-tuning format, not raw text")
    ds = load_records(spec, cache_dir, where)
    if spec.text_field not in ds.column_names:
        raise ValueError(
            f"{where}.text_field: column {spec.text_field!r} not in {spec.path!r}; available columns: "
            f"{ds.column_names}. Set text_field to one of them"
        )
    check_text_column(ds, spec, where)
    ds = ds.select_columns([spec.text_field])
    return ds.rename_column(spec.text_field, "text") if spec.text_field != "text" else ds


def check_text_column(ds: datasets.Dataset, spec: DatasetSpec, where: str) -> None:
    """``ValueError`` naming the file and line of the first record whose raw text is not a string."""

    files, fmt = local_files(spec, where) if os.path.exists(spec.path) else (None, None)
    problem = text_column_problem(ds, spec, files, fmt, where)
    if problem:
        raise ValueError(problem)


def load_text_datasets(
    specs: Iterable[DatasetSpec | Mapping[str, Any] | str], cache_dir: str | os.PathLike | None = None
) -> datasets.Dataset:
    """Load every spec and concatenate them, in order, into one ``text`` dataset."""
    parts = [load_text_dataset(s, cache_dir, where=f"datasets[{i}]") for i, s in enumerate(specs)]
    if not parts:
        raise ValueError("datasets: the list is empty; add at least one entry, e.g. {path: builtin:stdlib}")
    string = datasets.Features({"text": datasets.Value("string")})
    parts = [p if p.features == string else p.cast(string) for p in parts]
    return parts[0] if len(parts) == 1 else datasets.concatenate_datasets(parts)


def tokenize_dataset(
    ds: datasets.Dataset,
    tokenizer: PreTrainedTokenizerBase,
    cache_dir: str | os.PathLike | None = None,
    num_proc: int | None = None,
) -> datasets.Dataset:
    """Tokenize ``text`` into ``input_ids``, each document ending with eos; empty documents dropped.

    With ``cache_dir`` the result is cached in ``cache_dir/tokenized/`` keyed by the dataset's
    fingerprint and a hash of the tokenizer; concurrent ranks wait on a file lock for one writer.
    """
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ValueError("tokenizer has no eos token; it is needed to separate packed documents")

    def encode(batch: dict[str, list]) -> dict[str, list]:
        texts = [t for t in batch["text"] if t]
        ids = tokenizer(texts)["input_ids"] if texts else []
        return {"input_ids": [x if x and x[-1] == eos else [*x, eos] for x in ids]}

    features = datasets.Features({"input_ids": datasets.Sequence(datasets.Value("int32"))})
    kwargs: dict[str, Any] = dict(
        batched=True, remove_columns=ds.column_names, features=features, num_proc=num_proc, desc="tokenize"
    )
    return cached_map(
        ds, encode, cache_dir, "tokenized", f"{ds._fingerprint}-{tokenizer_hash(tokenizer)}", **kwargs
    )


def cached_map(
    ds: datasets.Dataset, fn, cache_dir: str | Path | None, kind: str, key: str, **kwargs: Any
) -> datasets.Dataset:
    """``ds.map(fn)``, its result kept at ``cache_dir/kind/key.arrow`` when a cache is given. A file
    lock lets one process (of a node's ranks, or of concurrent runs on a shared filesystem) build
    it while the others wait and then read it."""
    if cache_dir is None:
        return ds.map(fn, **kwargs)
    out_dir = Path(cache_dir) / kind
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{key}.arrow"
    with FileLock(str(path) + ".lock"):
        return ds.map(fn, cache_file_name=str(path), load_from_cache_file=True, **kwargs)


def tokenizer_hash(tokenizer: PreTrainedTokenizerBase) -> str:
    """Stable short hash of a fast tokenizer's full definition and special tokens."""
    h = hashlib.sha256(tokenizer.backend_tokenizer.to_str().encode())
    h.update(json.dumps([tokenizer.eos_token_id, tokenizer.bos_token_id, type(tokenizer).__name__]).encode())
    return h.hexdigest()[:16]


def looks_local(path: str) -> bool:
    """A path that cannot be a Hub name ("org/name"): relative/absolute, nested, or with a data extension."""
    return path.startswith((".", "/", "~")) or path.count("/") > 1 or _format_of(path) is not None


def _format_of(path: str) -> str | None:
    p = path.lower()
    for c in _COMPRESSION:
        p = p.removesuffix(c)
    return next((fmt for fmt, exts in FORMATS.items() if p.endswith(exts)), None)


RECORD_EXTENSIONS = (".arrow",)
"""Record files ndparallel does not read, named so that a plain-text ``type`` cannot take them."""


def format_conflict(spec: DatasetSpec, file: str, where: str) -> str | None:
    """Why ``spec`` would read ``file`` as a format its extension contradicts (``type`` spelled as a
    file format: ``text``, ``json``, ``parquet``, ``csv``), or None. ``ds_type`` is the explicit
    file format (Axolotl's) and is believed; the line parse then finds a file that is not it."""
    if spec.type not in FORMATS:
        return None
    name = Path(file).name
    if spec.ds_type is not None:
        if spec.ds_type == spec.type:
            return None
        return (
            f"{where}: type {spec.type!r} and ds_type {spec.ds_type!r} name two file formats for {name}; "
            "type is the prompt strategy (type: completion for raw text), ds_type the file format: keep one"
        )
    ext = _format_of(file) or ("arrow" if name.lower().endswith(RECORD_EXTENSIONS) else None)
    if ext is None or ext == spec.type:
        return None
    if spec.type == "text":
        return (
            f"{where}.type: 'text' would read {name} as plain text, but its extension says {ext} records: "
            "the records' syntax (braces, quotes, keys) would be trained as tokens. Use type: completion (it "
            "trains the text_field column, default 'text'), or ds_type: text without type if the raw lines "
            "really are the text"
        )
    if ext == "text":
        return (
            f"{where}.type: {spec.type!r} would read {name} as {spec.type} records, but its extension says "
            f"plain text: use type: completion (or leave type out) to train the text, or ds_type: "
            f"{spec.type} if the file really holds {spec.type} records"
        )
    return (
        f"{where}.type: {spec.type!r} would read {name} as {spec.type}, but its extension says {ext}: use "
        f"type: completion (format from the extension), or ds_type: {spec.type} if the file really is "
        f"{spec.type}"
    )


def local_files(spec: DatasetSpec, where: str) -> tuple[list[str], str]:
    """The files a local ``spec.path`` (a file or a directory) stands for, and their format
    (``ValueError`` when ``type`` names a format the extensions contradict: ``format_conflict``)."""
    path = Path(spec.path).expanduser()
    wanted = spec.ds_type or (spec.type if spec.type in FORMATS else None)
    if spec.split_name != "train":
        raise ValueError(
            f"{where}.split: {spec.split!r}, but local files are one split, train (the whole file): "
            f"write split: train (or a slice such as train[:90%]), point path at the {spec.split_name} "
            "file, or use val_set_size for a validation part"
        )
    if path.is_dir() and spec.data_files:
        files = [str(path / f) for f in spec.data_files]
        missing = [f for f in spec.data_files if not (path / f).is_file()]
        if missing:
            raise ValueError(f"{where}.data_files: {missing[0]!r} is not a file under {spec.path!r}")
        conflict = next(filter(None, (format_conflict(spec, f, where) for f in files)), None)
        if conflict:
            raise ValueError(conflict)
        kinds = sorted({wanted or _format_of(f) or "?" for f in files})
        if len(kinds) > 1 or "?" in kinds:
            raise ValueError(f"{where}.data_files: formats {kinds} (from the extensions); set ds_type")
        return files, kinds[0]
    if spec.data_files:
        raise ValueError(
            f"{where}.data_files: path {spec.path!r} is a file; data_files picks files of a "
            "directory or a Hub dataset (drop data_files, or point path at the directory)"
        )
    if path.is_dir():
        usable = (
            {wanted} if wanted else set(FORMATS) - (set() if spec.raw else {"text"})
        )  # records: no .md/.txt
        files = sorted(
            str(p)
            for p in path.rglob("*")
            if p.is_file()
            and not any(s.startswith(".") for s in p.relative_to(path).parts)
            and _format_of(p.name) in usable
        )
        kinds = sorted({_format_of(f) for f in files})
        if not files and spec.ds_type is None:
            others = (str(p) for p in sorted(path.rglob("*")) if p.is_file() and not p.name.startswith("."))
            conflict = next(filter(None, (format_conflict(spec, f, where) for f in others)), None)
            if conflict:
                raise ValueError(conflict)
        if not files:
            raise ValueError(
                f"{where}.path: directory {spec.path!r} holds no "
                f"{wanted or '/'.join(FORMATS)} files ({', '.join(sum(FORMATS.values(), ()))})"
            )
        if len(kinds) > 1:
            raise ValueError(
                f"{where}.path: directory {spec.path!r} mixes formats {kinds}; set type to one of them"
            )
        return files, kinds[0]
    conflict = format_conflict(spec, str(path), where)
    if conflict:
        raise ValueError(conflict)
    fmt = wanted or _format_of(path.name)
    if fmt is None:
        field = "type" if spec.raw else "ds_type"
        raise ValueError(
            f"{where}.{field}: cannot infer the format of {spec.path!r} from its extension; set "
            f"{field} to one of {list(FORMATS)}"
        )
    if fmt == "text" and not spec.raw:
        raise ValueError(
            f"{where}: type {spec.type!r} needs records (json, parquet or csv), not the plain-text "
            f"file {spec.path!r}"
        )
    return [str(path)], fmt


def _load_local(spec: DatasetSpec, cache_dir: str | os.PathLike | None, where: str) -> datasets.Dataset:
    files, fmt = local_files(spec, where)
    kwargs: dict[str, Any] = {"sample_by": spec.sample_by} if fmt == "text" else {}
    try:
        return datasets.load_dataset(
            fmt,
            data_files={spec.split_name: files},
            split=spec.split,
            cache_dir=None if cache_dir is None else str(Path(cache_dir) / "datasets"),
            **kwargs,
        )
    except Exception as e:  # noqa: BLE001 - a file datasets cannot parse is bad input: one line
        located = first_bad_line(
            files, fmt, required_columns(spec), spec.text_field if spec.raw else None, where
        )
        if located:
            raise ValueError(located) from None
        cause = e
        while cause.__cause__ is not None or cause.__context__ is not None:
            cause = cause.__cause__ or cause.__context__
        detail = " ".join(f"{type(cause).__name__}: {cause}".split())[:300]
        raise ValueError(
            f"{where}.path: {spec.path!r} could not be read as {fmt} ({detail}); check the "
            "file (e.g. `head` it) or set type"
        ) from None


def _load_hub(spec: DatasetSpec, cache_dir: str | os.PathLike | None, where: str) -> datasets.Dataset:
    offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
    if not offline and not reachable(endpoint):  # else datasets retries for ~25 s, then fails
        raise ValueError(
            f"{where}.path: {spec.path!r} is not a local file and {endpoint} cannot be reached: download "
            f"it where the Hub is reachable (`huggingface-cli download --repo-type dataset {spec.path} "
            "--local-dir DIR`) and set path to DIR, or set HF_HUB_OFFLINE=1 to use the local datasets "
            "cache"
        )
    try:
        return datasets.load_dataset(
            spec.path,
            spec.name,
            split=spec.split,
            data_files=list(spec.data_files) if spec.data_files else None,
            cache_dir=None if cache_dir is None else str(Path(cache_dir) / "datasets"),
        )
    except Exception as e:
        raise ValueError(
            f"{where}.path: {spec.path!r} is not a local file and could not be loaded from the Hugging "
            f"Face Hub ({type(e).__name__}: {e}); check the path, or the name/split when online"
        ) from e
