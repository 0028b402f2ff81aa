"""What a run builds from its config before training: the model config, the tokenizer, the packed
data. Used on the ranks (``trainer``) and before launch (``preflight``)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from ndparallel.config import TrainConfig
from ndparallel.data import PackedLoader, load_or_train_tokenizer
from ndparallel.data.chat import resolve_template
from ndparallel.data.dataset import DatasetSpec
from ndparallel.data.multipack import MultipackLoader, MultipackRows
from ndparallel.data.packing import PackedSplits
from ndparallel.data.prepare import build_data as build
from ndparallel.data.prepare import row_pad_id
from ndparallel.data.stream import StreamingLoader, TokenStream, check_stream
from ndparallel.data.widths import bucket_widths, width_multiple
from ndparallel.models.presets import is_preset, preset_config
from ndparallel.optim.build import build_optimizer
from ndparallel.optim.muon import MUON_BETAS


def model_config(cfg: TrainConfig, vocab_size: int | None = None):
    """The HF config of ``base_model``: a preset (vocab sized to the tokenizer) or a directory/id."""
    from transformers import AutoConfig

    overrides = cfg.overrides_of_model_config or {}
    if is_preset(cfg.base_model):
        return preset_config(
            cfg.base_model, **overrides, **({"vocab_size": vocab_size} if vocab_size else {})
        )
    config = AutoConfig.from_pretrained(
        cfg.base_model, trust_remote_code=cfg.trust_remote_code, revision=cfg.revision_of_model
    )
    for key, value in overrides.items():
        setattr(config, key, value)
    return config


def data_cache_dir(cfg: TrainConfig) -> Path:
    """Where tokenized data, rows and the built-in tokenizer are cached (``dataset_cache_dir``;
    default ``output_dir/../.cache``)."""
    return Path(cfg.dataset_cache_dir or Path(cfg.output_dir).parent / ".cache")


def load_tokenizer(cfg: TrainConfig, cache_dir: Path):
    """The run's tokenizer: ``tokenizer``, else base_model's, else (presets) a BPE trained on the
    built-in corpus slice the data uses (cached); then ``special_tokens`` and a named
    ``chat_template`` are set on it (it is saved with the model)."""

    source = cfg.tokenizer or ("builtin:stdlib" if is_preset(cfg.base_model) else cfg.base_model)
    kwargs = {}
    if source == "builtin:stdlib":
        kwargs["vocab_size"] = cfg.tokenizer_vocab_size
        for d in cfg.datasets:  # train on the same slice of the corpus the data uses
            if d.path == "builtin:stdlib":
                kwargs.update(max_files=d.max_files, max_bytes=d.max_bytes)
    if source == cfg.base_model and cfg.revision_of_model:
        kwargs["revision"] = cfg.revision_of_model
    tokenizer = load_or_train_tokenizer(source, cache_dir=cache_dir, **kwargs)
    set_special_tokens(tokenizer, cfg)
    if (cfg.chat_template and cfg.chat_template != "tokenizer_default") or cfg.chat_template_jinja:
        tokenizer.chat_template = resolve_template(
            tokenizer, cfg.chat_template, cfg.chat_template_jinja, "chat_template"
        )
    return tokenizer


def set_special_tokens(tokenizer, cfg: TrainConfig) -> None:
    """``special_tokens`` set on the tokenizer, added when not in its vocabulary; then ``tokens``
    added (Axolotl's order and way: not normalised, no stripping). The same on every process."""
    from tokenizers import AddedToken

    vocab = tokenizer.get_vocab()
    special = cfg.special_tokens.model_dump(exclude_none=True) if cfg.special_tokens else {}
    extra = special.pop("additional_special_tokens", None)
    if extra:
        tokenizer.add_special_tokens(
            {
                "additional_special_tokens": [
                    AddedToken(t, rstrip=False, lstrip=False, normalized=False) for t in extra
                ]
            },
            replace_extra_special_tokens=False,
        )
    for name, token in special.items():
        if token in vocab:
            setattr(tokenizer, name, token)
        else:
            tokenizer.add_special_tokens(
                {name: AddedToken(token, rstrip=False, lstrip=False, normalized=False)}
            )
    if cfg.tokens:
        tokenizer.add_tokens(
            [AddedToken(t, rstrip=False, lstrip=False, normalized=False) for t in cfg.tokens]
        )


def rounded_vocab(cfg: TrainConfig, tokens: int) -> int:
    """Rows for ``tokens`` tokens: rounded up to a multiple of 32 with
    ``resize_token_embeddings_to_32x`` and of ``tensor_parallel_size`` (TP shards the vocabulary
    evenly; the extra rows map to no token)."""
    multiple = math.lcm(32 if cfg.resize_token_embeddings_to_32x else 1, cfg.tensor_parallel_size)
    return -(-tokens // multiple) * multiple


def grown_vocab_size(cfg: TrainConfig, tokenizer, model_vocab: int) -> int | None:
    """The vocabulary a pretrained model needs when the tokenizer outgrew its ``model_vocab`` rows
    (added tokens; ``rounded_vocab``), else None."""
    n = len(tokenizer)
    return None if n <= model_vocab else rounded_vocab(cfg, n)


def build_data(cfg: TrainConfig, tokenizer, cache_dir: Path):
    """Train (and validation) rows: every rank builds the same (cached, file-locked). A streamed
    ``pretraining_dataset`` builds nothing ahead: its first record is checked, ``train_loader``
    reads it while training."""

    if cfg.pretraining_dataset is not None:
        for i, d in enumerate(cfg.pretraining_dataset):
            check_stream(DatasetSpec.from_any(d.model_dump()), f"pretraining_dataset[{i}]")
        return PackedSplits(None, None)
    return build([d.model_dump() for d in cfg.datasets], tokenizer, cfg.data_options(), cache_dir=cache_dir)


def train_loader(
    cfg: TrainConfig, splits, tokenizer, dp_rank: int, dp_size: int, widths: RowWidths | None = None
):
    """This rank's training loader: ``PackedLoader`` over the prepared rows (cut per ``widths``;
    none: as stored), or ``StreamingLoader`` over ``pretraining_dataset`` (its length: the run's
    micro-batches)."""

    if cfg.pretraining_dataset is None:
        return rows_loader(cfg, splits.train, tokenizer, dp_rank, dp_size, widths)

    specs = [DatasetSpec.from_any(d.model_dump()) for d in cfg.pretraining_dataset]
    return StreamingLoader(
        TokenStream(specs, tokenizer, cfg.sequence_len),
        cfg.micro_batch_size,
        dp_rank=dp_rank,
        dp_size=dp_size,
        per_document=bool(cfg.sample_packing),
        length=cfg.max_steps * cfg.gradient_accumulation_steps,
    )


def rows_loader(
    cfg: TrainConfig, rows, tokenizer, dp_rank: int, dp_size: int, widths: RowWidths | None = None
) -> PackedLoader:
    """``PackedLoader`` over prepared ``rows``; with ``sample_packing_order: multipack`` the rows
    are single samples, packed each epoch as Axolotl's sampler packs them (``MultipackLoader``)."""
    widths = widths or RowWidths(None, None)
    common = {
        "dp_rank": dp_rank,
        "dp_size": dp_size,
        "pad_to_multiple": widths.multiple,
        "buckets": widths.buckets,
    }
    if cfg.sample_packing and cfg.sample_packing_order == "multipack":
        samples = MultipackRows(
            rows,
            row_pad_id(tokenizer),
            seed=cfg.seed,
            world=dp_size,
            shuffle=not cfg.curriculum_sampling,
            bin_size=cfg.sample_packing_bin_size,
            group_size=cfg.sample_packing_group_size,
            sequential=cfg.sample_packing_sequentially,
        )
        return MultipackLoader(samples, cfg.micro_batch_size, **common)
    return PackedLoader(
        rows, cfg.micro_batch_size, seed=cfg.seed, shuffle=not cfg.curriculum_sampling, **common
    )


def optimizer_for(cfg: TrainConfig, params):

    betas = (cfg.adam_beta1, cfg.adam_beta2)
    if cfg.optimizer == "muon" and not {"adam_beta1", "adam_beta2"} <= cfg.model_fields_set:
        betas = MUON_BETAS
    return build_optimizer(
        params,
        cfg.optimizer,
        lr=cfg.learning_rate,
        weight_decay=cfg.weight_decay,
        betas=betas,
        eps=cfg.adam_epsilon,
    )


def row_widths(cfg: TrainConfig, dims) -> RowWidths:
    """How the loader cuts micro-batches of whole samples (``data/widths.py``): not at all with
    ``pad_to_sequence_len``; else after the longest row, rounded up to 8 and to what the layout
    ``dims`` (``ParallelDims``) needs of a sequence length (as ``Engine.seq_len_divisor``), and
    bucketed where a new width costs a recompilation (compile, fp8) or new stage buffers (pipeline
    parallel). The trainer and the pre-launch padding estimate ask it."""
    if cfg.pads_to_sequence_len():
        return RowWidths(None, None)
    divisor = dims.seq_len_divisor(cfg.sequence_parallel, cfg.cp_options().load_balance)
    multiple = width_multiple(divisor)
    bucketed = cfg.compile or cfg.fp8 or dims.pp_enabled
    return RowWidths(multiple, bucket_widths(cfg.sequence_len, multiple) if bucketed else None)


@dataclass(frozen=True)
class RowWidths:
    """``PackedLoader``'s ``pad_to_multiple`` and ``buckets``."""

    multiple: int | None
    buckets: tuple[int, ...] | None
