"""Checks of a training config against the world size, the model and the data, made before any
rank starts (``train``, ``--dry-run``, ``verify``), and the resolved plan ``--dry-run`` prints."""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path

from ndparallel.config import ConfigError, TrainConfig


def validate_layout(cfg: TrainConfig, world_size: int, check_local: bool = True, check_output: bool = True,
                    check_weights: bool = True):
    """Check the layout against the world size and the model before any rank starts; with
    ``check_local`` also what lives on this machine (data, tokenizer, device, resume checkpoint,
    and with ``check_output`` the output_dir; a ``--dry-run`` may check a config meant for another
    machine). ``check_weights=False``: a model directory may hold its config alone (``simulate``
    reads no weights). Returns (resolved ParallelismConfig, HF model config); raises
    ``ConfigError`` (one line) on the first problem."""
    from ndparallel.layout.config import ParallelismConfigError
    from ndparallel.preflight.model_check import (
        check_adapter,
        check_memory_options,
        check_model,
        resolve_model_config,
    )

    try:
        pc = cfg.parallelism_config().resolve(world_size)
    except ParallelismConfigError as e:
        raise ConfigError(str(e)) from None
    hf = resolve_model_config(cfg)
    check_model(cfg, hf, check_weights=check_weights)
    _check_experts(cfg, pc.dims, hf)
    check_adapter(cfg, hf, pc.tp_size, pc.ep_size or 1)
    from ndparallel.preflight.qlora_check import check_quantized_base

    check_quantized_base(cfg, hf, pc)  # load_in_4bit: torchao, no TP, NF4 shards of whole blocks
    check_memory_options(cfg, hf)
    from ndparallel.preflight.dry_checks import check_without_data

    check_without_data(cfg, hf)
    if cfg.missing_data_problem():
        raise ConfigError(cfg.missing_data_problem())
    if check_local:
        tokenizer = check_local_inputs(cfg, check_output=check_output)
        _check_added_tokens(cfg, tokenizer, hf)
    _check_family_layout(cfg, pc, hf)  # what the family cannot run at all, before which sizes would fit
    try:
        if pc.tp_enabled:
            from ndparallel.parallel.tensor import validate_tensor_parallel

            validate_tensor_parallel(hf, pc.tp_size, cfg.tp_options())
        if pc.cp_enabled:
            from ndparallel.parallel.context import validate_context_parallel

            validate_context_parallel(hf, pc.cp_size, cfg.sequence_len, pc.tp_size,
                                      strategy=cfg.cp_options().comm_strategy)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    _check_sequence_len(cfg, pc.dims)
    from ndparallel.preflight.pipeline_check import check_pipeline

    check_pipeline(cfg, pc, hf)
    if check_local:  # the GPU the run needs is the launching machine's (a dry run may check another's config)
        _check_fp8(cfg)
        _check_qat_device(cfg)
    return pc, hf


def _check_experts(cfg: TrainConfig, dims, hf) -> None:
    """``expert_parallel_size`` needs a mixture-of-experts model whose expert count it divides."""
    from ndparallel.models.moe import config_num_experts

    experts = config_num_experts(hf)
    if dims.ep_enabled and experts is None:
        raise ConfigError(f"expert_parallel_size={dims.ep}, but base_model={cfg.base_model!r} is not a "
                          "mixture-of-experts model (its config has no num_experts / num_local_experts / "
                          "n_routed_experts): set expert_parallel_size: 1")
    if experts is not None and experts % dims.ep:
        fits = [d for d in range(1, experts + 1) if experts % d == 0 and dims.ep_problem() is None]
        raise ConfigError(f"expert_parallel_size={dims.ep} does not divide the {experts} experts of "
                          f"base_model={cfg.base_model!r}: use one of {fits[:8]}")


def _check_family_layout(cfg: TrainConfig, pc, hf) -> None:
    """What the model family cannot run under the layout (``parallel.support``), on a meta model."""
    if not (pc.tp_enabled or pc.cp_enabled or pc.ep_enabled):
        return
    from ndparallel.parallel.support import layout_problem
    from ndparallel.preflight.model_check import meta_model

    tp = cfg.tp_options()
    problem = layout_problem(meta_model(cfg, hf), tp_size=pc.tp_size, cp_size=pc.cp_size,
                             sequence_parallel=tp.sequence_parallel, tp_plan=tp.plan, ep_size=pc.ep_size)
    if problem:
        raise ConfigError(problem)


def _check_sequence_len(cfg: TrainConfig, dims) -> None:
    """Rows are cut into CP chunks and, under sequence parallel, split over tp: one rule
    (``ParallelDims.seq_len_divisor``) for every layout."""
    divisor = dims.seq_len_divisor(cfg.sequence_parallel)
    if cfg.sequence_len % divisor:
        up = cfg.sequence_len + (-cfg.sequence_len) % divisor
        why = " and ".join(w for w, on in (
            (f"2·context_parallel_size = {dims.cp_chunks()} chunks", dims.cp_enabled),
            (f"sequence parallel splits each cp rank's tokens over tensor_parallel_size = {dims.tp}",
             cfg.sequence_parallel and dims.tp_enabled)) if on)
        raise ConfigError(f"sequence_len={cfg.sequence_len} is not a multiple of {divisor} ({why}): "
                          f"set sequence_len to a multiple of {divisor} (e.g. {up})")


def _check_fp8(cfg: TrainConfig) -> None:
    """fp8 needs torchao and a GPU of compute capability >= 8.9 (unless emulated)."""
    if not cfg.fp8:
        return
    import torch

    from ndparallel.parallel.float8 import float8_problem

    device = cfg.device if cfg.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    problem = float8_problem(cfg.float8_options(), device)
    if problem:
        raise ConfigError(f"fp8: {problem}")


def _check_qat_device(cfg: TrainConfig) -> None:
    """nvfp4 QAT runs fp4 matmuls: a Blackwell GPU (``parallel.qat.qat_device_problem``)."""
    if cfg.qat is None:
        return
    import torch

    from ndparallel.parallel.qat import qat_device_problem

    device = cfg.device if cfg.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    problem = qat_device_problem(cfg.qat_options(), device)
    if problem:
        raise ConfigError(f"qat: {problem}")


def _check_added_tokens(cfg: TrainConfig, tokenizer, hf) -> None:
    """Tokens new to ``base_model``'s vocabulary (``tokens``, ``special_tokens``) grow its
    embeddings: refused with LoRA (the new rows would stay frozen). ``hf`` gets the vocabulary the
    ranks will build (a preset's: the tokenizer's, rounded), which the TP / CP checks then see."""
    from ndparallel.models.presets import is_preset
    from ndparallel.training.build import grown_vocab_size, rounded_vocab

    hf = hf.get_text_config()  # a multimodal config: its text model's vocabulary
    if is_preset(cfg.base_model):  # built with a row per token of the run's tokenizer
        hf.vocab_size = rounded_vocab(cfg, len(tokenizer))
        return
    grown = grown_vocab_size(cfg, tokenizer, hf.vocab_size)
    if grown is None:
        return
    if cfg.adapter:
        raise ConfigError(f"tokens / special_tokens add {len(tokenizer) - hf.vocab_size} token(s) new to the "
                          f"vocabulary of base_model={cfg.base_model!r}; with adapter: lora their embedding rows "
                          "would stay frozen: use tokens it has, or full fine-tuning")
    hf.vocab_size = grown


def check_local_inputs(cfg: TrainConfig, check_output: bool = True, profile_comm: bool = False):
    """Device, output_dir, resume checkpoint, tokenizer and a first sample of each dataset file;
    returns the run's tokenizer."""
    import torch

    from ndparallel.data.check import check_dataset
    from ndparallel.training.outputs import plan_output_dir
    from ndparallel.training.trainer import resume_policy

    from ndparallel.tracking.run import missing_trackers

    missing = missing_trackers(cfg.trackers())
    if missing:
        raise ConfigError(f"trackers not installed: {'; '.join(missing)} (or turn them off in the config)")
    from ndparallel.tracking.credentials import tracker_problem

    problem = tracker_problem(cfg)
    if problem:
        raise ConfigError(problem)
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device: cuda, but there is no CUDA GPU here (torch {torch.__version__}, "
                          "torch.cuda.is_available() is False): set device: cpu or auto")
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
    from ndparallel.training.build import build_data, data_cache_dir, load_tokenizer

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
    from ndparallel.checkpoint.directory import list_checkpoints, validate_checkpoint

    r = cfg.resume_from_checkpoint
    if r in (None, "", "auto"):
        return
    problems = validate_checkpoint(Path(r).expanduser(), deep=False)  # the ranks re-hash it
    if problems:
        hint = (" (it holds checkpoint-N directories: pass one of them, or resume_from_checkpoint: auto)"
                if list_checkpoints(r) else "")
        raise ConfigError(f"resume_from_checkpoint={r!r} is not a usable checkpoint: "
                          + "; ".join(problems) + hint)


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def _check_tokenizer(cfg: TrainConfig) -> None:
    from ndparallel.data.dataset import looks_local
    from ndparallel.models.presets import is_preset

    if cfg.tokenizer and cfg.tokenizer != "builtin:stdlib":
        path = Path(cfg.tokenizer).expanduser()
        if not path.exists() and (looks_local(cfg.tokenizer) or "/" not in cfg.tokenizer):
            raise ConfigError(f"tokenizer={cfg.tokenizer!r} does not exist: give a directory holding "
                              "tokenizer.json (e.g. the base model's), or builtin:stdlib")
        if path.is_dir() and not any((path / f).is_file() for f in _TOKENIZER_FILES):
            raise ConfigError(f"tokenizer={cfg.tokenizer!r} holds no tokenizer files ({', '.join(_TOKENIZER_FILES)})")
        return
    model_dir = Path(cfg.base_model).expanduser()
    if not cfg.tokenizer and not is_preset(cfg.base_model) and model_dir.is_dir() and not any(
            (model_dir / f).is_file() for f in _TOKENIZER_FILES):
        raise ConfigError(f"base_model={cfg.base_model!r} holds no tokenizer ({', '.join(_TOKENIZER_FILES)}): "
                          "set tokenizer: to a tokenizer directory (or builtin:stdlib)")


def run_notes(cfg: TrainConfig, device_type: str | None = None) -> list[str]:
    """Things the user set that have no effect or behave differently from Axolotl, one line each,
    said once before launch (and in ``--dry-run``)."""
    from ndparallel.preflight.compat import compat_notes

    notes = []
    if cfg.max_steps is not None and "num_epochs" in cfg.model_fields_set:
        notes.append(f"max_steps {cfg.max_steps} (num_epochs {cfg.num_epochs:g} is ignored: max_steps wins)")
    stray = cfg.lora_fields_without_adapter()
    if stray:  # Axolotl ignores them too: its archived full fine-tuning configs keep them
        notes.append(f"{', '.join(stray)} set but no adapter: not used, every parameter is trained (full "
                     "fine-tuning, as in Axolotl); add adapter: lora to train LoRA adapters instead")
    if cfg.loss_watchdog_threshold is not None:
        notes.append(f"loss_watchdog_threshold {cfg.loss_watchdog_threshold:g}: " + (
            "stops training as Axolotl does (a warning, the final model saved, exit 0); loss_watchdog_action: "
            "fail exits 1 without a final model instead" if cfg.loss_watchdog_action == "stop" else
            "loss_watchdog_action: fail exits 1 without a final model (Axolotl stops gracefully and saves it)"))
    qat = cfg.qat_options()
    if qat.enabled and qat.weight_dtype not in ("mxfp4", "nvfp4") and not cfg.fsdp_config.activation_checkpointing:
        notes.append(f"qat ({qat.weight_dtype} weights) without activation checkpointing: every layer keeps a "
                     "rounded copy of its whole (unsharded) weights for backward, the model's weights again on "
                     "every rank (docs/qat.md): set gradient_checkpointing: true (or "
                     "fsdp_config.activation_checkpointing: true) unless `ndparallel plan --config` says it fits")
    from ndparallel.tracking.credentials import tracker_notes
    from ndparallel.preflight.data_notes import data_notes

    return notes + cfg._axolotl_notes + compat_notes(cfg, device_type) + tracker_notes(cfg) + data_notes(cfg)


def world_size_for(cfg: TrainConfig, nproc: int | None) -> int:
    if nproc is not None and nproc < 1:
        raise ConfigError(f"--nproc-per-node must be >= 1, got {nproc}")
    if "WORLD_SIZE" in os.environ:
        return int(os.environ["WORLD_SIZE"])
    sizes = [cfg.dp_replicate_size, cfg.dp_shard_size, cfg.tensor_parallel_size, cfg.context_parallel_size,
             cfg.pipeline_parallel_size]
    if -1 in sizes:
        return nproc or local_devices(cfg)
    total = 1
    for s in sizes:
        total *= s
    if nproc and nproc != total:
        raise ConfigError(f"--nproc-per-node {nproc} but the layout needs {total} ranks")
    return total


def local_devices(cfg: TrainConfig) -> int:
    """Ranks a degree of -1 fills on this machine without --nproc-per-node: every CUDA GPU (as
    Axolotl's launch uses them all); 1 on CPU."""
    import torch

    return torch.cuda.device_count() if cfg.device != "cpu" and torch.cuda.is_available() else 1
