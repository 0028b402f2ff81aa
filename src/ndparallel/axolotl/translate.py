"""An Axolotl config mapping translated into ndparallel's fields before validation.

``translate(raw, own_keys)`` applies ``keys``' table to a raw YAML mapping: renames and value
translations (``bf16: auto``, ``gradient_checkpointing``, FSDP1's ``fsdp:`` list and ``fsdp_``
prefixes, DeepSpeed ZeRO configs, ...), drops what is empty or has no effect, and collects one
``note`` per translated key and one ``problem`` (the key and the fix) per key it refuses. Keys it
does not know are left for the schema (``TrainConfig``), which refuses unknown ones with a
did-you-mean. Only the raw mapping is read: nothing here imports the schema.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ndparallel.axolotl.checkpoint import linearized_experts, model_quantization
from ndparallel.axolotl.compute_keys import (
    activation_offloading,
    attention_flag,
    attn_implementation,
    bf16,
    checkpointing_kwargs,
    gradient_checkpointing,
    liger,
    precision_flag,
    tf32,
    torch_compile,
)
from ndparallel.axolotl.keys import DATASET, PLUGINS, TOP, Translation, is_empty, set_field, short
from ndparallel.axolotl.layout_keys import (
    deepspeed,
    default_layout,
    fsdp_config,
    fsdp_list,
    fsdp_version,
)
from ndparallel.optim.names import OPTIMIZER_NAMES


def translate(raw: dict, own_keys: set[str]) -> Translation:
    """``raw`` (a parsed YAML mapping, not modified) as ndparallel's fields; ``own_keys``: the
    top-level keys ``TrainConfig`` accepts itself (names and aliases)."""
    t = Translation(dict(raw))
    for key in list(t.data):
        rule = TOP.get(key)
        if rule is None or (key in own_keys and key not in MAPPERS):
            continue
        value = t.data.pop(key) if key not in own_keys else t.data[key]
        if key in MAPPERS:
            MAPPERS[key](t, key, value)
        elif rule.kind == "noop" and not is_empty(value, rule.default):
            t.refuse(key, value, rule.text)
        elif rule.kind == "ignored" and not is_empty(value, rule.default):
            t.notes.append(f"{key}: {rule.text}")
    fsdp_config(t)
    default_layout(t)
    for name in ("datasets", "pretraining_dataset"):
        entries = t.data.get(name)
        if isinstance(entries, dict):
            entries = t.data[name] = [entries]
        if isinstance(entries, list):
            t.data[name] = [
                _dataset(t, f"{name}[{i}]", d) if isinstance(d, dict) else d for i, d in enumerate(entries)
            ]
    return t


# ----------------------------------------------------------------------- top-level value mappers


def _rename(target: str) -> Callable:
    def mapper(t: Translation, key: str, value: Any) -> None:
        if not is_empty(value):
            set_field(t, target, value, "", key)
            t.renamed[target] = key

    return mapper


def _load_in_8bit(t: Translation, key: str, value: Any) -> None:
    """8-bit LoRA -> LoRA on the unquantised base (said in a note); anything else: the field's own check."""
    if value is True and t.data.get("adapter") == "lora":
        t.data[key] = False
        t.notes.append(f"{key}: true -> {TOP[key].text.split('-> ', 1)[1]}")


def _note_if_set(t: Translation, key: str, value: Any) -> None:
    if not is_empty(value):
        t.notes.append(f"{key}: {short(value)}: {TOP[key].text}")


def _auto_resume(t: Translation, key: str, value: Any) -> None:
    if value is True and not t.data.get("resume_from_checkpoint"):
        set_field(
            t,
            "resume_from_checkpoint",
            "auto",
            "auto_resume_from_checkpoints: true -> resume_from_checkpoint: "
            "auto (the newest complete checkpoint in output_dir)",
            key,
        )


def _batch_size(t: Translation, key: str, value: Any) -> None:
    if is_empty(value):
        return
    micro = t.data.get("micro_batch_size") or 1
    if not isinstance(value, int) or value % micro:
        t.refuse(
            key,
            value,
            f"must be a multiple of micro_batch_size ({micro}); or set gradient_accumulation_steps instead",
        )
        return
    set_field(
        t,
        "gradient_accumulation_steps",
        value // micro,
        f"batch_size: {value} -> gradient_accumulation_steps: "
        f"{value // micro} (= batch_size / micro_batch_size per rank)",
        key,
    )


def _warmup_steps(t: Translation, key: str, value: Any) -> None:
    if isinstance(value, float) and 0 < value < 1:
        del t.data[key]
        set_field(
            t,
            "warmup_ratio",
            value,
            f"warmup_steps: {value:g} -> warmup_ratio: {value:g} (a value below 1 is a "
            "fraction of the run's steps, as transformers reads it)",
            key,
        )


def _strategy(steps: str, per_epoch: str, none: str, best_fix: str | None = None) -> Callable:
    """transformers' eval / save strategy: ``no`` -> neither ``steps`` nor ``per_epoch`` (``none``
    said), ``epoch`` -> ``per_epoch: 1``, ``steps`` -> as the config sets them."""

    def mapper(t: Translation, key: str, value: Any) -> None:
        if value in (None, "", "steps"):
            return
        if value == "no":
            t.data.pop(steps, None)
            t.data.pop(per_epoch, None)
            t.notes.append(f"{key}: no -> {none}")
        elif value == "epoch":
            set_field(t, per_epoch, 1, f"{key}: epoch -> {per_epoch}: 1", key)
        else:
            t.refuse(
                key,
                value,
                best_fix
                if value == "best" and best_fix
                else f"use no, epoch or steps (with {steps} / {per_epoch})",
            )

    return mapper


_eval_strategy = _strategy("eval_steps", "evals_per_epoch", "no evaluation during training")


def _causal_lm_eval(t: Translation, key: str, value: Any) -> None:
    metrics = t.data.get("eval_causal_lm_metrics") if key == "do_causal_lm_eval" else value
    if is_empty(value) or (key == "eval_causal_lm_metrics" and not t.data.get("do_causal_lm_eval", True)):
        return
    if not set(metrics or []) <= {"perplexity"}:
        t.refuse(
            key,
            value,
            "only perplexity is computed (eval_perplexity, from the eval loss): set "
            "eval_causal_lm_metrics: [perplexity] or remove it",
        )
    elif key == "do_causal_lm_eval":
        t.notes.append("do_causal_lm_eval: eval_perplexity is logged at every evaluation")


def _mean_resizing(t: Translation, key: str, value: Any) -> None:
    if value is True:
        t.notes.append(f"{key}: true: {TOP[key].text}")


def _accelerator_config(t: Translation, key: str, value: Any) -> None:
    if is_empty(value):
        return
    if value == {"gradient_accumulation_kwargs": {"sync_each_batch": True}}:
        t.notes.append(f"accelerator_config: {TOP[key].text}")
    else:
        t.refuse(
            key, value, "Accelerate settings are not read here (ndparallel is its own engine); remove it"
        )


OPTIMIZERS = {**dict.fromkeys(OPTIMIZER_NAMES), "adamw_hf": "adamw_torch"}
"""Axolotl's optimizer names ndparallel runs (the low-bit ones through torchao: ``optim_lowbit``)."""
SCHEDULERS = {"cosine": None, "linear": None, "constant": None, "constant_with_warmup": None}


def _choice(t: Translation, key: str, value: Any, known: dict, example: str) -> None:
    """A value ndparallel has (``known[value]`` None), renames (a string), or refuses with the choices."""
    if value is None or value in known and known[value] is None:
        return
    if value in known:
        t.data[key] = known[value]
        t.notes.append(f"{key}: {value} -> {known[value]}")
        return
    del t.data[key]
    hint = (
        " (the 8-bit / 4-bit optimizers run through torchao: adamw_8bit, adamw_torch_4bit, ...)"
        if isinstance(value, str) and any(s in value for s in ("8bit", "4bit", "paged"))
        else ""
    )
    t.refuse(
        key,
        value,
        f"not supported{hint}: use one of {[k for k, v in known.items() if v is None]} "
        f"(e.g. {key}: {example})",
    )


def _tokens(t: Translation, key: str, value: Any) -> None:
    """Older Axolotl configs give the bos / eos / pad / unk tokens as a ``tokens:`` mapping (today's
    Axolotl refuses it): they become ``special_tokens``; a list (new tokens) is left as is."""
    if (
        not isinstance(value, dict)
        or not value
        or not set(value) <= {"bos_token", "eos_token", "pad_token", "unk_token"}
    ):
        return
    special = t.data.get("special_tokens") or {}
    clash = sorted(k for k in value if k in special and special[k] != value[k])
    if not isinstance(special, dict) or clash:
        t.problems.append(
            f"'tokens' gives {clash or sorted(value)} as a mapping and special_tokens sets them "
            "otherwise; keep them under special_tokens only"
        )
        return
    del t.data[key]
    t.data["special_tokens"] = {**value, **special}
    t.notes.append(
        f"tokens: a mapping of {', '.join(sorted(value))} (older Axolotl's form) -> special_tokens"
    )


def _max_packed(t: Translation, key: str, value: Any) -> None:
    """Axolotl's old packing switch: rows of ``value`` tokens packed with samples."""
    if is_empty(value):
        return
    length = t.data.get("sequence_len")
    if not isinstance(value, int) or isinstance(value, bool) or value < 1 or length not in (None, value):
        t.refuse(
            key,
            value,
            f"its successor packs rows of sequence_len tokens: remove it and set sequence_len: "
            f"{value if isinstance(value, int) else 'N'} and sample_packing: true",
        )
        return
    if t.data.get("sample_packing") is False:
        t.refuse(key, value, "it packs samples but the config sets sample_packing: false; keep one")
        return
    t.data.update(sequence_len=value, sample_packing=True)
    t.notes.append(f"{key}: {value} -> sample_packing: true, sequence_len: {value} (its successor)")


def _zero_is_none(t: Translation, key: str, value: Any) -> None:
    if value == 0:
        del t.data[key]


def _dataset_processes(t: Translation, key: str, value: Any) -> None:
    _rename("dataset_processes")(t, key, value)


def _plugins(t: Translation, key: str, value: Any) -> None:
    """Axolotl's plugins (class names or paths): a note for each one ndparallel maps, the others refused."""
    if is_empty(value):
        return
    plugins = [value] if isinstance(value, str) or not isinstance(value, list) else value
    names = [str(p).rsplit(".", 1)[-1] for p in plugins]
    unknown = [p for p, name in zip(plugins, names) if name not in PLUGINS]
    if unknown:
        t.refuse(key, unknown, f"not supported; ndparallel maps only {', '.join(PLUGINS)}: remove the others")
    t.notes += [f"plugins: {name} -> {PLUGINS[name]}" for name in names if name in PLUGINS]


MAPPERS: dict[str, Callable[[Translation, str, Any], None]] = {
    "bf16": bf16,
    "tf32": tf32,
    "bfloat16": precision_flag,
    "float32": precision_flag,
    "float16": precision_flag,
    "gradient_checkpointing": gradient_checkpointing,
    "activation_offloading": activation_offloading,
    "gradient_checkpointing_kwargs": checkpointing_kwargs,
    "fsdp": fsdp_list,
    "fsdp_version": fsdp_version,
    "deepspeed": deepspeed,
    "fsdp_final_state_dict_type": _note_if_set,
    "sequence_parallel_degree": _rename("context_parallel_size"),
    "ddp_timeout": _rename("collective_timeout_s"),
    "auto_resume_from_checkpoints": _auto_resume,
    "batch_size": _batch_size,
    "warmup_steps": _warmup_steps,
    "eval_strategy": _eval_strategy,
    "evaluation_strategy": _eval_strategy,
    "save_strategy": _strategy(
        "save_steps",
        "saves_per_epoch",
        "no checkpoints during training (the final model is saved)",
        TOP["load_best_model_at_end"].text,
    ),
    "tokenizer_config": _rename("tokenizer"),
    "dataset_prepared_path": _rename("dataset_cache_dir"),
    "torch_compile_backend": _rename("compile_backend"),
    "dataset_num_proc": _dataset_processes,
    "model_type": _note_if_set,
    "type_of_model": _note_if_set,
    "evals_per_epoch": _zero_is_none,
    "saves_per_epoch": _zero_is_none,
    "tokenizer_type": _note_if_set,
    "tokenizer_use_fast": _note_if_set,
    "tokenizer_legacy": _note_if_set,
    "tokenizer_use_mistral_common": _note_if_set,
    "xformers_attention": attention_flag,
    "sage_attention": attention_flag,
    "eager_attention": attention_flag,
    "flex_attention": attention_flag,
    "attn_implementation": attn_implementation,
    "chunked_cross_entropy": _rename("chunked_loss"),
    "torch_compile": torch_compile,
    "do_causal_lm_eval": _causal_lm_eval,
    "eval_causal_lm_metrics": _causal_lm_eval,
    "mean_resizing_embeddings": _mean_resizing,
    "accelerator_config": _accelerator_config,
    "model_config": _rename("overrides_of_model_config"),
    "load_in_8bit": _load_in_8bit,
    "quantize_moe_experts": _note_if_set,
    "model_quantization_config": model_quantization,
    "model_quantization_config_kwargs": model_quantization,
    "llama4_linearized_experts": linearized_experts,
    "tokens": _tokens,
    "max_packed_sequence_len": _max_packed,
    "cut_cross_entropy": lambda t, k, v: None,  # the plugin's own switch (on by default)
    "optimizer": lambda t, k, v: _choice(t, k, v, OPTIMIZERS, "adamw_torch_fused"),
    "lr_scheduler": lambda t, k, v: _choice(t, k, v, SCHEDULERS, "cosine"),
    "plugins": _plugins,
    **{k: liger for k in TOP if k.startswith("liger_") and TOP[k].kind == "mapped"},
}
"""Keys whose value is translated (the rest of ``TOP`` follows its rule's kind)."""


# ---------------------------------------------------------------------------- nested sections
def _dataset(t: Translation, where: str, entry: dict) -> dict:
    d = dict(entry)
    roles = {k: d.pop(k) for k in ("message_field_role", "message_field_content") if k in d}
    if any(not is_empty(v) for v in roles.values()):
        mapping = dict(d.get("message_property_mappings") or {})
        for k, v in roles.items():
            if not is_empty(v):
                mapping.setdefault(k.removeprefix("message_field_"), v)
        d["message_property_mappings"] = mapping
        t.notes.append(f"{where}: message_field_role / message_field_content -> message_property_mappings")
    for old in ("text_column", "field"):
        if old in d and is_empty(d[old], "text"):
            del d[old]
        elif old in d:
            t.rename_in(d, where, old, "text_field")
    for key in list(d):
        rule = DATASET.get(key)
        if rule is not None and rule.kind == "noop":
            value = d.pop(key)
            if not is_empty(value, rule.default):
                t.refuse(f"{where}.{key}", value, rule.text)
    return d
