"""Checks of a training config against the world size, the model and the data, made before any
rank starts (``train``, ``--dry-run``, ``verify``), and the resolved plan ``--dry-run`` prints."""

from __future__ import annotations

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
        from ndparallel.preflight.local import _check_added_tokens, check_local_inputs

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
        from ndparallel.preflight.local import _check_fp8, _check_qat_device

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
