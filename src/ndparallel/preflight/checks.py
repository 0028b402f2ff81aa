"""The checks before launch: one list (``CHECKS``), run in order by one pass (``run_checks``) for
``train`` (before it starts a rank, and on every rank under torchrun), ``--dry-run``, ``verify``,
``simulate`` and ``launch``. A check reads the config — from ``layout`` and ``model`` on, also the
resolved layout and base_model's config — and returns notes (lines said once before launch) or
refuses with a one-line ``ConfigError``; the first refusal ends the pass. Adding a check is adding
its function here and its line in ``CHECKS``."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ndparallel.config import ConfigError, TrainConfig
from ndparallel.layout.config import ParallelismConfigError
from ndparallel.models.moe import config_num_experts
from ndparallel.preflight.host_memory import host_memory_note
from ndparallel.preflight.installed import missing_extras
from ndparallel.preflight.pipeline_check import check_pipeline
from ndparallel.techniques.host_budget import available_host_memory
from ndparallel.tracking.credentials import tracker_notes


@dataclass
class Preflight:
    """One pass: what the checks are given, and what they found."""

    cfg: TrainConfig
    world_size: int | None = None
    """None: the config alone (no layout, no model: the checks that need ``config`` only)."""
    check_local: bool = True
    """Also what lives on this machine (trackers, device, data, tokenizer, resume checkpoint, the GPU);
    a ``--dry-run`` may check a config meant for another machine."""
    check_output: bool = True
    """With ``check_local``: ``output_dir`` too (under torchrun, rank 0 claims it before its first write)."""
    check_weights: bool = True
    """A local base_model's safetensors headers against its config (``simulate`` reads no weights)."""
    device_type: str | None = None
    """The ranks' device type when the caller knows it: adds the attention-kernel and tf32 notes."""
    pc: Any = None
    """Found by ``layout``: the ``ParallelismConfig`` resolved against ``world_size``."""
    hf: Any = None
    """Found by ``model``: base_model's HF config (its vocabulary grown by the run's added tokens)."""
    notes: list[str] = field(default_factory=list)
    summaries: dict[str, str] = field(default_factory=dict)
    """Found by ``adapter`` / ``quantized_base``: their one-line summaries, which ``--dry-run``
    prints (``plan_text.describe_plan``) without building the adapted meta model again."""
    _meta: tuple | None = field(default=None, repr=False)

    def meta_model(self):
        """``base_model``'s architecture on the meta device, built when a check first asks and
        shared by the checks of this pass, which only read it (one that changes a model, such as
        the adapter's, builds its own): ~0.04 s a build. Built again if ``local inputs`` grew the
        vocabulary since."""
        from ndparallel.preflight.model_check import meta_model

        vocab = getattr(self.hf.get_text_config(), "vocab_size", None)
        if self._meta is None or self._meta[0] != vocab:
            self._meta = (vocab, meta_model(self.cfg, self.hf))
        return self._meta[1]


@dataclass(frozen=True)
class Check:
    name: str
    run: Callable[[Preflight], list[str] | None]
    needs: str = "model"
    """``config``: the config alone; ``model``: a world size (then the layout and base_model's config
    are known); ``local``: that, and ``check_local``."""


# --------------------------------------------------------------------- the layout and the model
def extras(p: Preflight) -> None:
    """The optional extras of the features the config asks for, installed here (``installed.py``);
    the trackers' only where the run starts (``--dry-run`` lists them)."""
    missing = missing_extras(p.cfg, trackers=p.check_local)
    if missing:
        raise ConfigError(missing)


def layout(p: Preflight) -> None:
    """The degrees against the world size (a -1 degree filled from it)."""

    try:
        p.pc = p.cfg.parallelism_config().resolve(p.world_size)
    except ParallelismConfigError as e:
        raise ConfigError(str(e)) from None


def model(p: Preflight) -> None:
    """base_model found; a causal decoder whose positions hold sequence_len, its local weights fitting
    its config."""
    from ndparallel.preflight.model_check import check_model, resolve_model_config

    p.hf = resolve_model_config(p.cfg)
    check_model(p.cfg, p.hf, check_weights=p.check_weights, meta=p.meta_model)


def experts(p: Preflight) -> None:
    """``expert_parallel_size`` needs a mixture-of-experts model whose expert count it divides."""

    cfg, dims, count = p.cfg, p.pc.dims, config_num_experts(p.hf)
    if dims.ep_enabled and count is None:
        raise ConfigError(
            f"expert_parallel_size={dims.ep}, but base_model={cfg.base_model!r} is not a "
            "mixture-of-experts model (its config has no num_experts / num_local_experts / "
            "n_routed_experts): set expert_parallel_size: 1"
        )
    if count is not None and count % dims.ep:
        fits = [d for d in range(1, count + 1) if count % d == 0 and dims.ep_problem() is None]
        raise ConfigError(
            f"expert_parallel_size={dims.ep} does not divide the {count} experts of "
            f"base_model={cfg.base_model!r}: use one of {fits[:8]}"
        )


def adapter(p: Preflight) -> None:
    from ndparallel.preflight.model_check import check_adapter

    summary = check_adapter(p.cfg, p.hf, p.pc.tp_size, p.pc.ep_size or 1, p.pc.pp_size)
    if summary is not None:
        p.summaries["adapter"] = summary


def quantized_base(p: Preflight) -> None:
    """load_in_4bit: torchao, no TP, NF4 shards of whole blocks."""
    from ndparallel.preflight.qlora_check import check_quantized_base

    summary = check_quantized_base(p.cfg, p.hf, p.pc)
    if summary is not None:
        p.summaries["quantised"] = summary


def memory_options(p: Preflight) -> None:
    from ndparallel.preflight.model_check import check_memory_options

    check_memory_options(p.cfg, p.hf, p.meta_model)


def chat_templates(p: Preflight) -> None:
    from ndparallel.preflight.dry_checks import check_chat_templates

    check_chat_templates(p.cfg)


def data_order(p: Preflight) -> None:
    from ndparallel.preflight.dry_checks import check_data_order

    check_data_order(p.cfg)


def qat_groups(p: Preflight) -> None:
    from ndparallel.preflight.dry_checks import check_qat_groups

    check_qat_groups(p.cfg, p.hf, p.meta_model)


def chunked_loss(p: Preflight) -> None:
    from ndparallel.preflight.dry_checks import check_chunked_loss

    check_chunked_loss(p.cfg, p.hf, p.meta_model)


def unfrozen_parameters(p: Preflight) -> None:
    from ndparallel.preflight.dry_checks import check_unfrozen_parameters

    check_unfrozen_parameters(p.cfg, p.hf, p.meta_model)


def data_given(p: Preflight) -> None:
    problem = p.cfg.missing_data_problem()
    if problem:
        raise ConfigError(problem)


def local_inputs(p: Preflight) -> list[str]:
    """Trackers, device, output_dir, resume checkpoint, tokenizer and every dataset (prepared and
    cached); the vocabulary the tokenizer adds, which the layout checks after this one then see.
    Notes: what Axolotl would warn about the prepared data (``data_notes.prepared_notes``)."""
    from ndparallel.preflight.data_notes import prepared_notes
    from ndparallel.preflight.local import _check_added_tokens, check_local_inputs, quiet_datasets

    tokenizer = check_local_inputs(p.cfg, check_output=p.check_output)
    _check_added_tokens(p.cfg, tokenizer, p.hf)
    with quiet_datasets():
        return prepared_notes(p.cfg, tokenizer)


def family_layout(p: Preflight) -> None:
    """What the model family cannot run under the layout at all (``parallel.support``, on a meta
    model), before which sizes would fit."""
    pc, tp = p.pc, p.cfg.tp_options()
    if not (pc.tp_enabled or pc.cp_enabled or pc.ep_enabled):
        return
    from ndparallel.parallel.support import layout_problem

    problem = layout_problem(
        p.meta_model(),
        tp_size=pc.tp_size,
        cp_size=pc.cp_size,
        tp=tp,
        ep_size=pc.ep_size,
    )
    if problem:
        raise ConfigError(problem)


def tp_cp_sizes(p: Preflight) -> None:
    """Heads, widths and the vocabulary divide by the TP degree; the sequence by CP's chunks."""
    cfg, pc, hf = p.cfg, p.pc, p.hf
    try:
        if pc.tp_enabled:
            from ndparallel.parallel.tp.tensor import validate_tensor_parallel

            validate_tensor_parallel(hf, pc.tp_size, cfg.tp_options())
        if pc.cp_enabled:
            from ndparallel.parallel.cp.context import validate_context_parallel

            validate_context_parallel(
                hf, pc.cp_size, cfg.sequence_len, pc.tp_size, strategy=cfg.cp_options().comm_strategy
            )
    except ValueError as e:
        raise ConfigError(str(e)) from None


def sequence_len(p: Preflight) -> None:
    """Rows are cut into CP chunks and, under sequence parallel, split over tp: one rule
    (``ParallelDims.seq_len_divisor``) for every layout."""
    cfg, dims = p.cfg, p.pc.dims
    divisor = dims.seq_len_divisor(cfg.sequence_parallel)
    if cfg.sequence_len % divisor:
        up = cfg.sequence_len + (-cfg.sequence_len) % divisor
        why = " and ".join(
            w
            for w, on in (
                (f"2·context_parallel_size = {dims.cp_chunks()} chunks", dims.cp_enabled),
                (
                    f"sequence parallel splits each cp rank's tokens over tensor_parallel_size = {dims.tp}",
                    cfg.sequence_parallel and dims.tp_enabled,
                ),
            )
            if on
        )
        raise ConfigError(
            f"sequence_len={cfg.sequence_len} is not a multiple of {divisor} ({why}): "
            f"set sequence_len to a multiple of {divisor} (e.g. {up})"
        )


def pipeline(p: Preflight) -> None:

    check_pipeline(p.cfg, p.pc, p.hf)


def gpu_features(p: Preflight) -> None:
    """fp8 and nvfp4 QAT on the launching machine's GPU."""
    from ndparallel.preflight.local import _check_fp8, _check_qat_device

    _check_fp8(p.cfg)
    _check_qat_device(p.cfg)


# ----------------------------------------------------------------------------------- notes
def max_steps_wins(p: Preflight) -> list[str]:
    cfg = p.cfg
    if cfg.max_steps is not None and "num_epochs" in cfg.model_fields_set:
        return [f"max_steps {cfg.max_steps} (num_epochs {cfg.num_epochs:g} is ignored: max_steps wins)"]
    return []


def lora_fields_unused(p: Preflight) -> list[str]:
    """Axolotl ignores them too: its archived full fine-tuning configs keep them."""
    stray = p.cfg.lora_fields_without_adapter()
    return (
        [
            f"{', '.join(stray)} set but no adapter: not used, every parameter is trained (full fine-tuning, "
            f"as in "
            "Axolotl); add adapter: lora to train LoRA adapters instead"
        ]
        if stray
        else []
    )


def loss_watchdog(p: Preflight) -> list[str]:
    cfg = p.cfg
    if cfg.loss_watchdog_threshold is None:
        return []
    return [
        f"loss_watchdog_threshold {cfg.loss_watchdog_threshold:g}: "
        + (
            "stops training as Axolotl does (a warning, the final model saved, exit 0); "
            "loss_watchdog_action: "
            "fail exits 1 without a final model instead"
            if cfg.loss_watchdog_action == "stop"
            else "loss_watchdog_action: fail exits 1 without a final model (Axolotl stops gracefully and "
            "saves it)"
        )
    ]


def qat_memory(p: Preflight) -> list[str]:
    cfg, qat = p.cfg, p.cfg.qat_options()
    if (
        qat.enabled
        and qat.weight_dtype not in ("mxfp4", "nvfp4")
        and not cfg.fsdp_config.activation_checkpointing
    ):
        return [
            f"qat ({qat.weight_dtype} weights) without activation checkpointing: every layer keeps a rounded "
            "copy of its whole (unsharded) weights for backward, the model's weights again on every rank "
            "(docs/qat.md): set fsdp_config.activation_checkpointing: true unless `ndparallel plan --config` "
            "says it fits"
        ]
    return []


def translated_keys(p: Preflight) -> list[str]:
    """What the front door translated (``axolotl/translate.py``)."""
    return list(p.cfg._axolotl_notes)


def differences(p: Preflight) -> list[str]:
    """Fields that behave differently from Axolotl's (``compat.py``)."""
    from ndparallel.preflight.compat import compat_notes

    return compat_notes(p.cfg, p.device_type)


def quantisation(p: Preflight) -> list[str]:
    from ndparallel.preflight.compat import quant_notes

    return quant_notes(p.cfg)


def trackers(p: Preflight) -> list[str]:

    return tracker_notes(p.cfg)


def data(p: Preflight) -> list[str]:
    from ndparallel.preflight.data_notes import data_notes

    return data_notes(p.cfg)


def host_memory(p: Preflight) -> list[str]:
    """Offloaded activations against this machine's host memory (``host_memory.py``): its ranks
    are ``LOCAL_WORLD_SIZE`` under a launcher, else the whole world (``ndparallel train``)."""
    ranks_here = int(os.environ.get("LOCAL_WORLD_SIZE", p.world_size))
    note = host_memory_note(p.cfg, p.pc, p.hf, ranks_here, available_host_memory())
    return [note] if note else []


def model_notes(p: Preflight) -> list[str]:
    """A multimodal checkpoint trained on text, positions extrapolated, packing with token mixers."""
    from ndparallel.preflight.dry_checks import model_notes as notes

    return notes(p.cfg, p.hf, p.meta_model)


CHECKS: tuple[Check, ...] = (
    Check("extras", extras),
    Check("layout", layout),
    Check("model", model),
    Check("experts", experts),
    Check("adapter", adapter),
    Check("quantized base", quantized_base),
    Check("memory options", memory_options),
    Check("chat templates", chat_templates),
    Check("data order", data_order),
    Check("qat groups", qat_groups),
    Check("chunked loss", chunked_loss),
    Check("unfrozen parameters", unfrozen_parameters),
    Check("data given", data_given),
    Check("local inputs", local_inputs, needs="local"),
    Check("host memory", host_memory, needs="local"),
    Check("family layout", family_layout),
    Check("tp / cp sizes", tp_cp_sizes),
    Check("sequence_len", sequence_len),
    Check("pipeline", pipeline),
    Check("gpu features", gpu_features, needs="local"),
    Check("max_steps wins", max_steps_wins, needs="config"),
    Check("lora fields unused", lora_fields_unused, needs="config"),
    Check("loss watchdog", loss_watchdog, needs="config"),
    Check("qat memory", qat_memory, needs="config"),
    Check("translated keys", translated_keys, needs="config"),
    Check("differences", differences, needs="config"),
    Check("quantisation", quantisation, needs="config"),
    Check("trackers", trackers, needs="config"),
    Check("data", data, needs="config"),
    Check("model notes", model_notes),
)
"""In the order they run: a refusal found earlier is the one said (e.g. what a family cannot run
at all, before which sizes would fit); the notes come last, in the order they are printed."""


def run_checks(
    cfg: TrainConfig,
    world_size: int | None = None,
    *,
    check_local: bool = True,
    check_output: bool = True,
    check_weights: bool = True,
    device_type: str | None = None,
) -> Preflight:
    """Every check of ``CHECKS`` that applies (``Preflight`` says what each flag means), in order.
    Raises ``ConfigError`` (one line) on the first refusal; else returns the pass: the resolved
    layout (``pc``), base_model's config (``hf``) and the notes."""
    p = Preflight(cfg, world_size, check_local, check_output, check_weights, device_type)
    for check in CHECKS:
        if check.needs == "config" or (world_size is not None and (check.needs == "model" or check_local)):
            p.notes += check.run(p) or []
    return p


def validate_layout(
    cfg: TrainConfig,
    world_size: int,
    check_local: bool = True,
    check_output: bool = True,
    check_weights: bool = True,
):
    """``run_checks`` for callers that need (resolved ParallelismConfig, HF model config) alone."""
    p = run_checks(
        cfg, world_size, check_local=check_local, check_output=check_output, check_weights=check_weights
    )
    return p.pc, p.hf


def run_notes(cfg: TrainConfig, device_type: str | None = None) -> list[str]:
    """The notes of the checks that read the config alone (no layout, no model, no machine)."""
    return run_checks(cfg, device_type=device_type).notes
