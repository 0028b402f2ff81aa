"""What a run builds from its config before training: the model config, the tokenizer, the packed
data. Used on the ranks (``trainer``) and before launch (``preflight``)."""

from __future__ import annotations

from pathlib import Path

from ndparallel.training.config import TrainConfig


def model_config(cfg: TrainConfig, vocab_size: int | None = None):
    """The HF config of ``base_model``: a preset (vocab sized to the tokenizer) or a directory/id."""
    from transformers import AutoConfig

    from ndparallel.models.presets import is_preset, preset_config

    if is_preset(cfg.base_model):
        return preset_config(cfg.base_model, **({"vocab_size": vocab_size} if vocab_size else {}))
    return AutoConfig.from_pretrained(cfg.base_model, trust_remote_code=cfg.trust_remote_code)


def load_tokenizer(cfg: TrainConfig, cache_dir: Path):
    """The run's tokenizer: ``tokenizer``, else base_model's, else (presets) a BPE trained on the
    built-in corpus slice the data uses (cached)."""
    from ndparallel.data import load_or_train_tokenizer
    from ndparallel.models.presets import is_preset

    source = cfg.tokenizer or ("builtin:stdlib" if is_preset(cfg.base_model) else cfg.base_model)
    kwargs = {}
    if source == "builtin:stdlib":
        kwargs["vocab_size"] = cfg.tokenizer_vocab_size
        for d in cfg.datasets:  # train on the same slice of the corpus the data uses
            if d.path == "builtin:stdlib":
                kwargs.update(max_files=d.max_files, max_bytes=d.max_bytes)
    return load_or_train_tokenizer(source, cache_dir=cache_dir, **kwargs)


def build_data(cfg: TrainConfig, tokenizer, cache_dir: Path):
    """Train (and validation) blocks: every rank builds the same (cached, file-locked)."""
    from ndparallel.data import build_blocks

    return build_blocks([d.model_dump() for d in cfg.datasets], tokenizer, cfg.sequence_len,
                        val_set_size=cfg.val_set_size, seed=cfg.seed, cache_dir=cache_dir)


def optimizer_for(cfg: TrainConfig, params):
    from ndparallel.training.optim import build_optimizer

    return build_optimizer(params, cfg.optimizer, lr=cfg.learning_rate, weight_decay=cfg.weight_decay,
                           betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_epsilon)
