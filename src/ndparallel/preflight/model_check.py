"""``base_model`` before any rank starts: find its config (a preset, a local directory, a cached or
reachable Hub id — never minutes of Hub retries), and check that it is a causal decoder, that
``sequence_len`` fits its positions, and that its safetensors headers fit its config (no tensor
data read). Every problem is one ``ConfigError`` line naming ``base_model`` and the fix."""

from __future__ import annotations

import contextlib
import difflib
import os
import re
import warnings
from pathlib import Path

from ndparallel.config import ConfigError, TrainConfig
from ndparallel.models.adapter_files import adapter_weights_problem
from ndparallel.models.adapters import (
    adapter_config_of,
    apply_adapter,
    base_model_of,
    checkpoint_key,
    is_lora_layer,
    is_param_wrapper,
)
from ndparallel.models.causal import causal_lm_problem, config_problem, learned_position_tables
from ndparallel.models.layers import dense_mlps, outer_decoder_layers
from ndparallel.models.loading import checkpoint_files
from ndparallel.models.multimodal import causal_lm_from_config, old_layout_hint
from ndparallel.models.presets import PRESETS, PUBLISHED, is_preset, preset_config, published_config
from ndparallel.models.weights import weights_problem
from ndparallel.parallel.pp.stages import adapter_pipeline_problem
from ndparallel.parallel.support import adapter_layout_problem
from ndparallel.runtime.network import reachable
from ndparallel.techniques.selective_ac import is_selective

_HUB_ID = re.compile(r"^[\w.-]+/[\w.-]+$")


def one_line(text: object) -> str:
    return " ".join(str(text).split())


def resolve_model_config(cfg: TrainConfig):
    """The HF config of ``cfg.base_model`` (with ``overrides_of_model_config``), or ``ConfigError``
    saying what the name is not."""
    config = _base_model_config(cfg)
    for key, value in (cfg.overrides_of_model_config or {}).items():
        setattr(config, key, value)
    return config


def _base_model_config(cfg: TrainConfig):

    name = cfg.base_model
    if cfg.revision_of_model and (is_preset(name) or Path(name).expanduser().exists()):
        raise ConfigError(
            f"revision_of_model={cfg.revision_of_model!r} picks a revision of a Hub base_model, but "
            f"base_model={name!r} is {'a built-in preset' if is_preset(name) else 'a local path'}: "
            "remove it, or give the Hub id as base_model"
        )
    if is_preset(name):
        return preset_config(name, vocab_size=cfg.tokenizer_vocab_size)
    path = Path(name).expanduser()
    if path.exists():
        if not path.is_dir():
            raise ConfigError(
                f"base_model={name!r} is a file: give the model directory (holding config.json)"
            )
        if not (path / "config.json").is_file():
            raise ConfigError(f"base_model={name!r} has no config.json: not a Hugging Face model directory")
        return _auto_config(name, path, cfg.trust_remote_code)
    known = published_config(name)  # a well-known hub id: validated offline from its published shape
    if known is not None:
        return known
    if is_hub_id(name):
        return _hub_config(name, cfg.trust_remote_code, cfg.revision_of_model)
    if "/" not in name and not name.startswith((".", "~")):
        close = difflib.get_close_matches(name, [*PRESETS, *PUBLISHED], n=1, cutoff=0.6)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ConfigError(
            f"base_model={name!r}: unknown preset{hint} (built-in presets: {', '.join(PRESETS)}; "
            "or give a local model directory or a Hub id org/name)"
        )
    raise ConfigError(
        f"base_model={name!r}: the local path {path} does not exist (relative paths are taken "
        f"from the current directory, {os.getcwd()})"
    )


def is_hub_id(name: str) -> bool:
    """``org/name`` whose first part is not a local directory (then it is a missing local path)."""
    return bool(_HUB_ID.match(name)) and not Path(name.split("/")[0]).is_dir()


def _auto_config(name: str, source, trust_remote_code: bool, **kwargs):
    from transformers import AutoConfig

    try:
        with quiet_transformers():
            return AutoConfig.from_pretrained(source, trust_remote_code=trust_remote_code, **kwargs)
    except Exception as e:  # noqa: BLE001 - unreadable config.json, unknown model_type, ...
        raise ConfigError(f"base_model={name!r} cannot be read: {one_line(e)[:400]}") from None


def _hub_config(name: str, trust_remote_code: bool, revision: str | None = None):
    with contextlib.suppress(Exception):  # the local HF cache first: no network
        with quiet_transformers():
            from transformers import AutoConfig

            return AutoConfig.from_pretrained(
                name, local_files_only=True, trust_remote_code=trust_remote_code, revision=revision
            )
    fix = (
        f"download it where the Hub is reachable (`huggingface-cli download {name} --local-dir DIR`) "
        "and give DIR"
    )
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on"):
        raise ConfigError(
            f"base_model={name!r} is not a local directory and not in the local Hugging Face "
            f"cache, and HF_HUB_OFFLINE is set: {fix}"
        )
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
    if not reachable(endpoint):
        raise ConfigError(
            f"base_model={name!r} is not a local directory and not in the local Hugging Face "
            f"cache, and {endpoint} cannot be reached: {fix}"
        )
    return _auto_config(name, name, trust_remote_code, revision=revision)


@contextlib.contextmanager
def quiet_transformers():
    """No transformers warnings (e.g. BERT's "add is_decoder=True") on the one-line error path."""
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        hf_logging.set_verbosity(level)


def check_model(cfg: TrainConfig, hf, check_weights: bool = True, meta=None) -> None:
    """Causal decoder? ``sequence_len`` within its positions? Local weights fit the config (with
    ``check_weights``)? ``meta``: see ``shared_meta_model``."""

    problem = config_problem(hf, cfg.trust_remote_code)
    if problem:
        raise ConfigError(f"base_model={cfg.base_model!r}: {problem}")
    tables = beyond_learned_positions(cfg, hf, meta)
    if tables:
        raise ConfigError(
            f"sequence_len={cfg.sequence_len} is larger than the model's max_position_embeddings="
            f"{hf.max_position_embeddings} (base_model={cfg.base_model!r}), and its positions are a "
            f"learned table ({tables[0]}) with no row past that: lower sequence_len"
        )
    if is_preset(cfg.base_model) or (
        published_config(cfg.base_model) is not None and not Path(cfg.base_model).exists()
    ):
        if cfg.fsdp_config.layer_classes:
            _check_layer_classes(cfg, shared_meta_model(cfg, hf, meta))
        return  # built-in or published shapes: known causal decoders, no local weights to check
    model = shared_meta_model(cfg, hf, meta)
    problem = causal_lm_problem(model)
    if problem:
        raise ConfigError(f"base_model={cfg.base_model!r}: {problem}")
    _check_layer_classes(cfg, model)
    path = Path(cfg.base_model).expanduser()
    if path.is_dir() and check_weights:
        _check_weights(cfg, model, path)


def _check_layer_classes(cfg: TrainConfig, model) -> None:
    """``fsdp_config.layer_classes`` names classes of this model."""
    names = cfg.fsdp_config.layer_classes
    if not names:
        return
    present = {type(m).__name__ for m in model.modules()}
    missing = sorted(set(names) - present)
    if missing:
        layers = sorted(n for n in present if n.endswith(("DecoderLayer", "Block", "Layer")))
        raise ConfigError(
            f"fsdp_config.layer_classes {missing} is not a class of "
            f"base_model={cfg.base_model!r} (its layers: {layers[:6]}); set it to the decoder-layer "
            "class, or remove it"
        )


def beyond_positions(cfg: TrainConfig, hf) -> int | None:
    """The model's ``max_position_embeddings`` when ``sequence_len`` goes past it (else None)."""
    positions = getattr(hf.get_text_config(), "max_position_embeddings", None)  # multimodal: its text model's
    return positions if isinstance(positions, int) and cfg.sequence_len > positions else None


def beyond_learned_positions(cfg: TrainConfig, hf, meta=None) -> list[str]:
    """The learned position tables that ``sequence_len`` overruns (none for rotary / ALiBi models,
    which compute positions: ``dry_checks.model_notes`` says they extrapolate)."""

    positions = beyond_positions(cfg, hf)
    return [] if positions is None else learned_position_tables(shared_meta_model(cfg, hf, meta), positions)


def meta_model(cfg: TrainConfig, hf):
    """``base_model``'s architecture on the meta device (no memory); ``ConfigError`` if it cannot be built."""
    import torch

    try:
        with quiet_transformers(), torch.device("meta"):
            return causal_lm_from_config(hf, trust_remote_code=cfg.trust_remote_code)
    except Exception as e:  # noqa: BLE001 - a config transformers cannot build a model from
        raise ConfigError(
            f"base_model={cfg.base_model!r}: no model can be built from its config: {one_line(e)[:300]}"
        ) from None


def shared_meta_model(cfg: TrainConfig, hf, meta=None):
    """The meta model of a pre-launch pass: ``meta()`` when the caller shares one among its checks
    (``Preflight.meta_model``: built once, read only), else a new one (``meta_model``)."""
    return meta() if meta is not None else meta_model(cfg, hf)


def _check_weights(cfg: TrainConfig, model, path: Path) -> None:

    try:
        files = checkpoint_files(path)
        problem = weights_problem(model, files, str(path / "config.json"))
    except (OSError, ValueError) as e:
        problem = one_line(e)
    if problem:
        raise ConfigError(f"base_model={cfg.base_model!r}: {problem}")


def check_adapter(cfg: TrainConfig, hf, tp_size: int, ep_size: int = 1, pp_size: int = 1) -> str | None:
    """``adapter: lora`` before launch: peft installed, the targets exist in the model (PEFT applied
    to a meta-device copy), no embedding adapted under TP, no tied trained embedding cut into
    pipeline stages. Returns a one-line summary of the adapter
    (None without one); ``lora_*`` fields without an adapter are a note (``preflight.run_notes``)."""
    if cfg.adapter is None:
        return None
    import torch.nn as nn

    model = _saved_adapter_model(cfg, hf) if cfg.lora_model_dir else _adaptedmeta_model(cfg, hf)
    layers = {n: m for n, m in base_model_of(model).named_modules() if is_lora_layer(m)}
    odd = [n for n, m in layers.items() if not isinstance(m.base_layer, nn.Linear)]

    problem = adapter_layout_problem(base_model_of(model), tp_size, ep_size)
    if problem is None and pp_size > 1:
        problem = adapter_pipeline_problem(model)
    if problem:
        raise ConfigError(problem)
    if odd and tp_size > 1:
        raise ConfigError(
            f"lora_target_modules: {odd[0]} ({type(layers[odd[0]].base_layer).__name__}): "
            "with tensor_parallel_size > 1 LoRA adapts linear layers only: leave it out"
        )
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    names = sorted({n.rsplit(".", 1)[-1] for n in layers if not is_param_wrapper(layers[n])})
    names += sorted(
        {
            ".".join(checkpoint_key(f"{n}.{m.parameter_name}").split(".")[-2:])
            for n, m in layers.items()
            if is_param_wrapper(m)
        }
    )
    if cfg.lora_modules_to_save:
        names.append(f"trained whole: {', '.join(cfg.lora_modules_to_save)}")
    lora = adapter_config_of(model)
    start = f"; starts from {cfg.lora_model_dir}" if cfg.lora_model_dir else ""
    return (
        f"LoRA r={lora.r} alpha={lora.lora_alpha:g} dropout={lora.lora_dropout:g} on "
        f"{len(layers)} layers ({', '.join(names)}); {trainable / 1e6:.2f}M trainable parameters "
        f"= {100 * trainable / total:.3f}% of {total / 1e6:,.1f}M; base frozen in "
        f"{'4-bit NF4 (linears) + ' if cfg.load_in_4bit else ''}{cfg.compute_dtype_name()}{start}"
    )


def _adaptedmeta_model(cfg: TrainConfig, hf, lora_config=None):
    """A meta-device copy of the model wrapped with the run's LoRA config (or ``lora_config``); its
    LoRA layers are on the meta device too (a 70B model's would take seconds and gigabytes)."""
    import torch

    try:
        with quiet_transformers(), torch.device("meta"):
            return apply_adapter(meta_model(cfg, hf), lora_config or cfg.lora_config())
    except ImportError as e:
        raise ConfigError(f"adapter: lora: {e}") from None
    except (ValueError, TypeError, KeyError) as e:  # PEFT: "Target modules {...} not found ..."
        message = one_line(e)[:300]
        if message.startswith("lora_"):  # ours, naming its field
            raise ConfigError(message) from None
        hint = old_layout_hint(cfg.lora_target_modules)
        raise ConfigError(f"lora_target_modules={cfg.lora_target_modules!r}: {hint or message}") from None


def _adapted_layers(model) -> list[str]:

    return sorted(n for n, m in base_model_of(model).named_modules() if is_lora_layer(m))


def _saved_adapter_model(cfg: TrainConfig, hf):
    """``lora_model_dir``: the saved config readable and agreeing with every ``lora_*`` field the
    YAML sets, its tensors (headers only) fitting the model wrapped with it."""

    where = f"lora_model_dir={cfg.lora_model_dir!r}"
    try:
        saved = cfg.lora_config()
    except ImportError as e:
        raise ConfigError(f"adapter: lora: {e}") from None
    except ValueError as e:
        raise ConfigError(f"{where}: {one_line(e)}") from None
    for field, value in (("lora_r", saved.r), ("lora_alpha", saved.lora_alpha)):
        if field in cfg.model_fields_set and float(getattr(cfg, field)) != float(value):
            raise ConfigError(
                f"{field}={getattr(cfg, field):g} but the adapter in {cfg.lora_model_dir} has "
                f"{value:g}: remove {field} (the saved adapter decides) or set it to {value:g}"
            )
    model = _adaptedmeta_model(cfg, hf, saved)
    if {"lora_target_modules", "lora_target_linear"} & cfg.model_fields_set:
        mine = _adapted_layers(_adaptedmeta_model(cfg, hf, cfg.lora_config_from_fields()))
        theirs = _adapted_layers(model)
        if mine != theirs:
            raise ConfigError(
                f"lora_target_modules / lora_target_linear adapt {len(mine)} layers, the adapter "
                f"in {cfg.lora_model_dir} adapts {len(theirs)}: remove them (the saved adapter "
                "decides) or make them match it"
            )
    problem = adapter_weights_problem(model, cfg.lora_model_dir)
    if problem:
        raise ConfigError(f"{where}: {problem}")
    return model


def check_memory_options(cfg: TrainConfig, hf, meta=None) -> None:
    """``tiled_mlp`` needs a dense ``mlp`` block in every decoder layer, ``activation_offloading``
    layers checkpointed by transformers (``GradientCheckpointingLayer``): checked on a meta model."""
    if not (cfg.tiled_mlp or cfg.activation_offloading):
        return
    from transformers.modeling_layers import GradientCheckpointingLayer

    model = shared_meta_model(cfg, hf, meta)
    classes = tuple(cfg.fsdp_config.layer_classes) if cfg.fsdp_config.layer_classes else None
    try:
        mlps = dense_mlps(model, classes) if cfg.tiled_mlp else []
        layers = outer_decoder_layers(model, classes)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if mlps and type(mlps[0]).__name__ in (classes or ()):
        raise ConfigError(
            f"tiled_mlp: fsdp_config.layer_classes names the MLP ({type(mlps[0]).__name__}), so "
            "FSDP would gather its parameters once per tile; shard whole decoder layers (leave "
            "layer_classes unset) or turn tiled_mlp off"
        )
    wraps_checkpoint = not is_selective(cfg.fsdp_config)  # selective: hooks around any layer's forward
    checkpointed = all(isinstance(m, GradientCheckpointingLayer) for m in layers)
    if cfg.activation_offloading and wraps_checkpoint and not checkpointed:
        raise ConfigError(
            f"activation_offloading: {type(layers[0]).__name__} is not checkpointed by transformers' "
            "GradientCheckpointingLayer, whose checkpoint function ndparallel wraps; turn it off"
        )
