"""Checks that need the model's config but no data and no weights (entries of ``checks.CHECKS``, so
``--dry-run`` runs them as well as ``train``): named chat templates exist, the data-order switches
fit the data, ``chunked_loss: true`` is exact for the family, the ``unfrozen_parameters`` patterns
name parameters of the model, ``qat.group_size`` divides every linear's input width. So a config
``--dry-run`` passes is not refused later for a reason it could have known. Also the notes and
``--dry-run`` lines that depend on the model. ``meta``: the pass's shared meta model
(``model_check.shared_meta_model``)."""

from __future__ import annotations

from ndparallel.config import ConfigError, TrainConfig
from ndparallel.data.chat import check_template_name
from ndparallel.data.dataset import DatasetSpec
from ndparallel.data.prepare import concatenates
from ndparallel.models.heads import plain_head_problem
from ndparallel.models.multimodal import multimodal_class, multimodal_note
from ndparallel.preflight.model_check import beyond_positions, shared_meta_model
from ndparallel.techniques.qat import group_size_problem
from ndparallel.training.controls import unmatched_patterns


def check_chat_templates(cfg: TrainConfig) -> None:
    """The config's and every chat_template dataset's template is one that exists."""

    try:
        if cfg.chat_template:
            check_template_name(cfg.chat_template, "config", cfg.chat_template_jinja)
        for i, d in enumerate(cfg.datasets or []):
            spec = DatasetSpec.from_any(d.model_dump(), f"datasets[{i}]")
            if spec.type == "chat_template" and not spec.chat_template_jinja:
                check_template_name(
                    spec.chat_template or cfg.chat_template, f"datasets[{i}]", cfg.chat_template_jinja
                )
    except ValueError as e:
        raise ConfigError(str(e)) from None


def check_data_order(cfg: TrainConfig) -> None:
    """Deduplication and the data-order switches fit the data; a streamed dataset is not sliced."""
    try:
        _check_data_order(cfg)
        _check_multipack(cfg)
        for i, d in enumerate(cfg.pretraining_dataset or []):
            if "[" in d.split:
                raise ValueError(
                    f"pretraining_dataset[{i}].split: {d.split!r}: a streamed dataset has no length to "
                    "slice by; give a split name (e.g. train) and use skip: N to skip records"
                )
    except ValueError as e:
        raise ConfigError(str(e)) from None


def check_qat_groups(cfg: TrainConfig, hf, meta=None) -> None:
    if cfg.qat is not None:
        problem = group_size_problem(shared_meta_model(cfg, hf, meta), cfg.qat_options())
        if problem:
            raise ConfigError(f"qat: {problem}")


def check_chunked_loss(cfg: TrainConfig, hf, meta=None) -> None:
    if cfg.chunked_loss:
        problem = chunked_loss_problem(cfg, hf, meta)
        if problem:
            raise ConfigError(
                f"chunked_loss: true, but the chunked loss would not be exact for base_model="
                f"{cfg.base_model!r}: {problem}; set chunked_loss: false or leave it out (auto: the "
                "logits path for this model)"
            )


def check_unfrozen_parameters(cfg: TrainConfig, hf, meta=None) -> None:
    if cfg.unfrozen_parameters and cfg.adapter is None:
        names = [n for n, _ in shared_meta_model(cfg, hf, meta).named_parameters()]
        missing = unmatched_patterns(names, cfg.unfrozen_parameters)
        if missing:
            raise ConfigError(
                f"unfrozen_parameters: {missing[0]!r} matches no parameter of base_model="
                f"{cfg.base_model!r} (its parameters are named like {names[0]!r}, {names[-1]!r}); "
                "fix the pattern (re.match from the start of the name)"
            )


def _check_data_order(cfg: TrainConfig) -> None:
    """Deduplication and the data-order switches apply to whole samples, not to streamed or
    concatenated raw text."""

    switches = [
        k
        for k in ("dataset_exact_deduplication", "curriculum_sampling", "sample_packing_sequentially")
        if getattr(cfg, k)
    ]
    if not switches:
        return
    if cfg.pretraining_dataset is not None:
        raise ValueError(
            f"{switches[0]}: true with a streamed pretraining_dataset (read once, in its own order, "
            "never deduplicated): remove it, or give the data under datasets:"
        )
    specs = [DatasetSpec.from_any(d.model_dump()) for d in cfg.datasets]
    if cfg.dataset_exact_deduplication and concatenates(specs, cfg.sample_packing):
        raise ValueError(
            "dataset_exact_deduplication: true, but raw text is concatenated into blocks here "
            "(sample_packing unset): set sample_packing: true (or false) to train whole samples, "
            "which are deduplicated"
        )
    if cfg.sample_packing_sequentially and not cfg.sample_packing:
        raise ValueError(
            "sample_packing_sequentially: true without sample_packing: true (one sample per row: "
            "nothing is packed); set sample_packing: true, or remove it"
        )


VARLEN_ATTENTION = ("flash_attention_2", "flash_attention_3", "flex_attention")
"""Kernels with which Axolotl packs a micro-batch into one row (``multipack_real_batches`` unset)."""


def _check_multipack(cfg: TrainConfig) -> None:
    """``sample_packing_order: multipack`` gives Axolotl's packed rows; refused where it cannot."""
    if cfg.sample_packing_order != "multipack":
        return
    why = None
    if not cfg.sample_packing:
        why = "without sample_packing: true (nothing is packed); set sample_packing: true, or remove it"
    elif cfg.pretraining_dataset is not None:
        why = "with a streamed pretraining_dataset (packed as it streams); remove it"
    elif cfg.sample_packing_boundary_targets:
        why = (
            "and sample_packing_boundary_targets: true are not offered together (rows are packed as "
            "they are read); remove one"
        )
    elif (
        cfg.micro_batch_size > 1
        and cfg.attn_implementation in VARLEN_ATTENTION
        and not cfg.multipack_real_batches
    ):
        n = cfg.micro_batch_size
        why = (
            f"with attn_implementation: {cfg.attn_implementation} and micro_batch_size: {n}: Axolotl packs "
            f"one row of {n} x sequence_len tokens there, ndparallel {n} rows of sequence_len (Axolotl's "
            f"multipack_real_batches: true); set multipack_real_batches: true, or micro_batch_size: 1 "
            f"and sequence_len: {n * cfg.sequence_len} for Axolotl's rows"
        )
    if why:
        raise ValueError(f"sample_packing_order: multipack {why}")


def chunked_loss_problem(cfg: TrainConfig, hf, meta=None) -> str | None:
    """Why the chunked loss would not be exact for this model (None: it is)."""

    if cfg.qat is not None:
        return "qat fake-quantises the LM head (more than a matmul)"
    return plain_head_problem(shared_meta_model(cfg, hf, meta))


def qat_summary(cfg: TrainConfig) -> str:
    """The ``qat`` line of ``--dry-run``."""
    o = cfg.qat_options()
    groups = (
        f"groups of {o.group_size}"
        if o.weight_dtype == "int4"
        else {"nvfp4": "blocks of 16", "mxfp4": "blocks of 32"}.get(o.weight_dtype)
    )
    text = f"{o.weight_dtype} weights" + (f" ({groups})" if groups else "")
    text += f" + {o.activation_dtype} activations" if o.activation_dtype else " (weights only)"
    text += ", embedding too" if o.quantize_embedding else ""
    text += f", from step {o.fake_quant_after_n_steps + 1}" if o.fake_quant_after_n_steps else ""
    return (
        text + ": torchao fake quantisation of every linear (LM head included); the model is saved "
        "unquantised: quantise it afterwards with the same settings"
    )


def chunked_loss_state(cfg: TrainConfig, hf, meta=None) -> str:
    """What ``chunked_loss`` resolves to for this model, for ``--dry-run``."""
    if cfg.chunked_loss is False:
        return "off"
    problem = chunked_loss_problem(cfg, hf, meta)
    return "on" if problem is None else f"off ({problem}: the logits path)"


def model_notes(cfg: TrainConfig, hf, meta=None) -> list[str]:
    """Notes that depend on the model: a multimodal checkpoint trained on text, ``sequence_len``
    past the model's positions (rotary / ALiBi: extrapolated), sample packing with token mixers
    other than attention."""

    notes = [multimodal_note(shared_meta_model(cfg, hf, meta))] if multimodal_class(hf) is not None else []
    positions = beyond_positions(cfg, hf)
    if positions is not None:
        notes.append(
            f"sequence_len={cfg.sequence_len} goes past the model's max_position_embeddings={positions}: "
            "its computed (rotary / ALiBi) positions extrapolate beyond the trained context, as in "
            "Axolotl; a rope_scaling in config.json extends the context properly"
        )
    return notes + _packing_notes(cfg, hf, meta)


def _packing_notes(cfg: TrainConfig, hf, meta=None) -> list[str]:
    if not cfg.sample_packing:
        return []
    import torch.nn as nn

    language = [m for n, m in shared_meta_model(cfg, hf, meta).named_modules() if not _in_tower(n)]
    mixers = sorted({type(m).__name__ for m in language if isinstance(m, nn.Conv1d)})
    if not mixers:
        return []
    return [
        f"sample_packing: {hf.model_type} also mixes tokens outside attention (convolution / state-space "
        "layers): packed samples influence each other there, as in Axolotl without varlen kernels; "
        "sample_packing: false trains each sample alone"
    ]


def _in_tower(name: str) -> bool:
    return any(part.startswith(("vision", "visual", "audio", "multi_modal")) for part in name.split("."))
