"""What lives on the machine a run starts from, checked before any rank starts: the trackers'
credentials, the device, ``output_dir``, the resume checkpoint, the tokenizer, every dataset
(tokenised and packed into the cache the ranks then read), the vocabulary that tokenizer adds, and
the GPU that fp8 / nvfp4 QAT need."""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path

from ndparallel.checkpoint.directory import list_checkpoints, validate_checkpoint
from ndparallel.config import ConfigError, TrainConfig
from ndparallel.data.check import check_dataset
from ndparallel.data.dataset import looks_local
from ndparallel.models.presets import is_preset
from ndparallel.preflight.world import run_device
from ndparallel.techniques.float8 import float8_problem
from ndparallel.techniques.qat import qat_device_problem
from ndparallel.tracking.credentials import tracker_problem
from ndparallel.training.components import (
    build_data,
    data_cache_dir,
    grown_vocab_size,
    load_tokenizer,
    rounded_vocab,
)
from ndparallel.training.outputs import plan_output_dir
from ndparallel.training.trainer import resume_policy


def check_local_inputs(cfg: TrainConfig, check_output: bool = True, profile_comm: bool = False):
    """Device, output_dir, resume checkpoint, tokenizer and a first sample of each dataset file;
    returns the run's tokenizer."""
    import torch

    problem = tracker_problem(cfg)
    if problem:
        raise ConfigError(problem)
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError(
            f"device: cuda, but there is no CUDA GPU here (torch {torch.__version__}, "
            "torch.cuda.is_available() is False): set device: cpu or auto"
        )
    resuming = resume_policy(cfg.resume_from_checkpoint, os.environ) is not None
    conflicts = plan_output_dir(cfg, resuming, profile_comm).conflicts if check_output else []
    if conflicts:
        raise ConfigError(conflicts[0])
    _check_resume_path(cfg)
    _check_tokenizer(cfg)
    for i, d in enumerate(cfg.datasets):
        try:
            check_dataset(d.model_dump(), f"datasets[{i}]")
        except ValueError as e:
            raise ConfigError(str(e)) from None
    return prepare_data(cfg)[0]


def prepare_data(cfg: TrainConfig):
    """Tokenize and pack every dataset (cached) before any rank starts, so that each data problem
    (a bad record anywhere, a missing column, nothing left after filtering, too little data) ends
    here in one line, and the ranks find everything cached. Returns (tokenizer, splits)."""

    with quiet_datasets():
        try:
            tokenizer = load_tokenizer(cfg, data_cache_dir(cfg))
            return tokenizer, build_data(cfg, tokenizer, data_cache_dir(cfg))
        except (ValueError, OSError) as e:
            raise ConfigError(str(e)) from None


@contextlib.contextmanager
def quiet_datasets():
    """``datasets``' own error logs off (the one line naming the problem says it) and its progress
    bars only on a terminal, for the block."""
    import datasets

    level = datasets.logging.get_verbosity()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)
    bars_were_off = not datasets.is_progress_bar_enabled()
    if not sys.stderr.isatty():
        datasets.disable_progress_bars()
    try:
        yield
    finally:
        datasets.logging.set_verbosity(level)
        if not bars_were_off:
            datasets.enable_progress_bars()


def _check_resume_path(cfg: TrainConfig) -> None:

    r = cfg.resume_from_checkpoint
    if r in (None, "", "auto"):
        return
    problems = validate_checkpoint(Path(r).expanduser(), deep=False)  # the ranks re-hash it
    if problems:
        hint = (
            " (it holds checkpoint-N directories: pass one of them, or resume_from_checkpoint: auto)"
            if list_checkpoints(r)
            else ""
        )
        raise ConfigError(
            f"resume_from_checkpoint={r!r} is not a usable checkpoint: " + "; ".join(problems) + hint
        )


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def _check_tokenizer(cfg: TrainConfig) -> None:

    if cfg.tokenizer and cfg.tokenizer != "builtin:stdlib":
        path = Path(cfg.tokenizer).expanduser()
        if not path.exists() and (looks_local(cfg.tokenizer) or "/" not in cfg.tokenizer):
            raise ConfigError(
                f"tokenizer={cfg.tokenizer!r} does not exist: give a directory holding "
                "tokenizer.json (e.g. the base model's), or builtin:stdlib"
            )
        if path.is_dir() and not any((path / f).is_file() for f in _TOKENIZER_FILES):
            raise ConfigError(
                f"tokenizer={cfg.tokenizer!r} holds no tokenizer files ({', '.join(_TOKENIZER_FILES)})"
            )
        return
    model_dir = Path(cfg.base_model).expanduser()
    if (
        not cfg.tokenizer
        and not is_preset(cfg.base_model)
        and model_dir.is_dir()
        and not any((model_dir / f).is_file() for f in _TOKENIZER_FILES)
    ):
        raise ConfigError(
            f"base_model={cfg.base_model!r} holds no tokenizer ({', '.join(_TOKENIZER_FILES)}): "
            "set tokenizer: to a tokenizer directory (or builtin:stdlib)"
        )


def _check_added_tokens(cfg: TrainConfig, tokenizer, hf) -> None:
    """Tokens new to ``base_model``'s vocabulary (``tokens``, ``special_tokens``) grow its
    embeddings: refused with LoRA (the new rows would stay frozen). ``hf`` gets the vocabulary the
    ranks will build (a preset's: the tokenizer's, rounded), which the TP / CP checks then see."""

    hf = hf.get_text_config()  # a multimodal config: its text model's vocabulary
    if is_preset(cfg.base_model):  # built with a row per token of the run's tokenizer
        hf.vocab_size = rounded_vocab(cfg, len(tokenizer))
        return
    grown = grown_vocab_size(cfg, tokenizer, hf.vocab_size)
    if grown is None:
        return
    if cfg.adapter:
        raise ConfigError(
            f"tokens / special_tokens add {len(tokenizer) - hf.vocab_size} token(s) new to the "
            f"vocabulary of base_model={cfg.base_model!r}; with adapter: lora their embedding rows "
            "would stay frozen: use tokens it has, or full fine-tuning"
        )
    hf.vocab_size = grown


def _check_fp8(cfg: TrainConfig) -> None:
    """fp8 needs torchao and a GPU of compute capability >= 8.9 (unless emulated)."""
    if not cfg.fp8:
        return

    problem = float8_problem(cfg.float8_options(), run_device(cfg))
    if problem:
        raise ConfigError(f"fp8: {problem}")


def _check_qat_device(cfg: TrainConfig) -> None:
    """nvfp4 QAT runs fp4 matmuls: a Blackwell GPU (``parallel.qat.qat_device_problem``)."""
    if cfg.qat is None:
        return

    problem = qat_device_problem(cfg.qat_options(), run_device(cfg))
    if problem:
        raise ConfigError(f"qat: {problem}")
