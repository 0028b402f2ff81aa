"""Data settings that are accepted but mean less (or other) than they seem, said once before
launch (and in ``--dry-run``), one line each (issue #37's sweep; docs/data.md lists them)."""

from __future__ import annotations

from pathlib import Path

from ndparallel.data.dataset import DatasetSpec


def data_notes(cfg) -> list[str]:
    """``train_on_inputs`` with types that have no prompt; a ``dataset_cache_dir`` holding
    Axolotl's prepared datasets (not read: ndparallel tokenises into its own keyed caches)."""

    notes = []
    specs = [DatasetSpec.from_any(d.model_dump(), f"datasets[{i}]") for i, d in enumerate(cfg.datasets or [])]
    if cfg.train_on_inputs and specs:
        raw = [f"datasets[{i}]" for i, s in enumerate(specs) if s.raw]
        segments = [f"datasets[{i}]" for i, s in enumerate(specs) if s.type == "input_output"]
        if raw:
            notes.append(
                f"train_on_inputs: true changes nothing for {', '.join(raw)} (raw text has no prompt: every "
                "token is trained already)"
            )
        if segments:
            notes.append(
                f"train_on_inputs: true trains every segment of {', '.join(segments)}, the label: false "
                "ones too (as in Axolotl); set it false to train only the labelled segments"
            )
    cache = Path(cfg.dataset_cache_dir).expanduser() if cfg.dataset_cache_dir else None
    if cache is not None and cache.is_dir():
        prepared = sorted(p.parent.name for p in cache.glob("*/dataset_info.json"))
        if prepared:
            notes.append(
                f"dataset_cache_dir={str(cache)!r} holds Axolotl's prepared datasets ({prepared[0]}"
                f"{', ...' if len(prepared) > 1 else ''}): ndparallel does not read them; it tokenises "
                "the datasets: again into its own caches beside them (keyed by data, tokenizer and "
                "settings, so another config's cache is never reused)"
            )
    return notes
