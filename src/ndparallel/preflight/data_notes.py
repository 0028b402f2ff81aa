"""Data settings that are accepted but mean less (or other) than they seem, said once before
launch (and in ``--dry-run``), one line each (issue #37's sweep; docs/data.md lists them)."""

from __future__ import annotations

from pathlib import Path

from ndparallel.data.chat import eot_warning, resolve_template
from ndparallel.data.dataset import DatasetSpec
from ndparallel.data.prepare import concatenates, prepare_samples, tokenize_specs
from ndparallel.training.components import data_cache_dir


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


def prepared_notes(cfg, tokenizer) -> list[str]:
    """What the prepared data holds that Axolotl would warn about: samples longer than
    ``sequence_len`` dropped (or truncated), and chat templates whose turn end is not trained
    because ``eot_tokens`` is unset. Reads the cached tokenized datasets (``prepare_data`` made them)."""
    if not cfg.datasets:
        return []
    specs = [DatasetSpec.from_any(d.model_dump(), f"datasets[{i}]") for i, d in enumerate(cfg.datasets)]
    notes = []
    for i, spec in enumerate(specs):
        if spec.type != "chat_template":
            continue
        name, jinja = (
            (spec.chat_template, spec.chat_template_jinja)
            if spec.chat_template or spec.chat_template_jinja
            else (cfg.chat_template, cfg.chat_template_jinja)
        )
        template = resolve_template(tokenizer, name, jinja, f"datasets[{i}]")
        warning = eot_warning(
            template, tokenizer.eos_token, tuple(cfg.eot_tokens or ()) or None, f"datasets[{i}]"
        )
        if warning:
            notes.append(warning)
    if concatenates(specs, cfg.sample_packing):
        return notes
    options, cache = cfg.data_options(), data_cache_dir(cfg)
    stats = prepare_samples(
        specs, tokenizer, options, cache, tokenize_specs(specs, tokenizer, options, cache)
    ).stats
    if stats.dropped_too_long:
        notes.append(
            f"datasets: {stats.dropped_too_long} of {stats.records} samples are longer than sequence_len="
            f"{cfg.sequence_len} and are dropped (excess_length_strategy: drop, Axolotl's default; Axolotl "
            'says "Dropped N sequences outside valid range"); truncate keeps them cut'
        )
    if stats.truncated:
        notes.append(
            f"datasets: {stats.truncated} of {stats.records} samples are longer than sequence_len="
            f"{cfg.sequence_len} and are truncated (excess_length_strategy: truncate: an answer cut "
            "without its eos)"
        )
    return notes
