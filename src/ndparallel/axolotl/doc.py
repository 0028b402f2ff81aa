"""The Axolotl-key tables of docs/axolotl.md (a summary, then every key), generated from ``keys`` and
the schema (``tests/test_axolotl_examples.py`` checks the page holds exactly this text, so it cannot go
stale). ``python -m ndparallel.axolotl.doc`` rewrites it between its markers."""

from __future__ import annotations

import sys
from pathlib import Path

from ndparallel.axolotl.keys import DATASET, FSDP, PLUGINS, TOP, Rule

BEGIN, END = (
    "<!-- axolotl-keys:begin (generated: python -m ndparallel.axolotl.doc) -->",
    "<!-- axolotl-keys:end -->",
)
HONOURED = (
    "base_model tokenizer_config trust_remote_code attn_implementation flash_attention sdp_attention "
    "dp_replicate_size dp_shard_size tensor_parallel_size context_parallel_size fsdp_config fsdp_version "
    "torch_compile torch_compile_backend fp8 qat adapter lora_r lora_alpha lora_dropout lora_target_modules "
    "lora_target_linear lora_model_dir merge_lora peft_use_rslora lora_modules_to_save "
    "lora_target_parameters "
    "datasets pretraining_dataset val_set_size "
    "sequence_len sample_packing pad_to_sequence_len train_on_inputs excess_length_strategy chat_template "
    "chat_template_jinja chat_template_kwargs eot_tokens special_tokens tokens "
    "resize_token_embeddings_to_32x "
    "dataset_prepared_path dataset_processes micro_batch_size gradient_accumulation_steps num_epochs "
    "max_steps "
    "learning_rate lr_scheduler warmup_steps warmup_ratio cosine_min_lr_ratio cosine_constant_lr_ratio "
    "lr_quadratic_warmup optimizer weight_decay adam_beta1 adam_beta2 adam_epsilon max_grad_norm bf16 fp16 "
    "tf32 "
    "seed output_dir logging_steps eval_steps evals_per_epoch save_steps saves_per_epoch save_total_limit "
    "resume_from_checkpoint early_stopping_patience loss_watchdog_threshold loss_watchdog_patience "
    "unfrozen_parameters reinit_weights min_sample_len use_wandb wandb_project wandb_entity wandb_name "
    "wandb_run_id wandb_mode wandb_watch wandb_log_model use_tensorboard use_mlflow mlflow_tracking_uri "
    "mlflow_experiment_name mlflow_run_name hf_mlflow_log_artifacts device revision_of_model model_revision "
    "dataset_exact_deduplication curriculum_sampling shuffle_merged_datasets sample_packing_sequentially "
    "use_swanlab swanlab_project "
    "swanlab_experiment_name swanlab_description swanlab_workspace swanlab_mode use_otel_metrics "
    "otel_metrics_host "
    "otel_metrics_port"
).split()
"""Axolotl's top-level keys ``TrainConfig`` reads under the same name (``tokenizer_config`` via the
translation; ``wandb_watch``, ``wandb_log_model`` and ``hf_mlflow_log_artifacts``: empty only)."""


def _names(keys) -> str:
    return ", ".join(f"`{k}`" for k in sorted(keys))


def summary_table() -> str:
    mapped = [k for k, r in TOP.items() if r.kind in ("mapped", "ignored") and k not in HONOURED]
    noop = [k for k, r in TOP.items() if r.kind == "noop"]
    rows = [
        "| Axolotl keys | what ndparallel does |",
        "|---|---|",
        f"| honoured ({len(HONOURED)}) | read under the same name: {_names(HONOURED)} |",
        f"| mapped ({len(mapped)}) | translated to ndparallel's equivalent, or accepted where it changes "
        f"nothing "
        f"here; `--dry-run` says which in one `note:` line each: {_names(mapped)} |",
        f"| no-op when empty, else refused ({len(noop)}) | accepted when empty, false or Axolotl's default; "
        f"set, refused with the fix: {_names(noop)} |",
        f"| plugins | {', '.join(f'`{p}` -> {what}' for p, what in PLUGINS.items())}; others refused |",
    ]
    return "\n".join(rows)


def _grouped(table: dict[str, Rule], kinds: tuple[str, ...]) -> list[str]:
    groups: dict[tuple[str, str], list[str]] = {}
    for key, rule in table.items():
        if rule.kind in kinds:
            groups.setdefault((rule.kind, rule.text), []).append(key)
    label = {"mapped": "mapped", "ignored": "accepted, no effect", "noop": "no-op when empty; set: refused"}
    return [
        f"| {_names(keys)} | {label[kind]} | {text.replace('|', '/')} |"
        for (kind, text), keys in sorted(groups.items(), key=lambda g: (g[0][0], sorted(g[1])[0]))
    ]


def docs_table() -> str:
    head = ["| keys | kind | to what / the fix when set |", "|---|---|---|"]
    rows = [*head, *_grouped(TOP, ("mapped",)), *_grouped(TOP, ("ignored",)), *_grouped(TOP, ("noop",))]
    nested = [*head, *_grouped(DATASET, ("mapped", "ignored", "noop"))]
    fsdp = [*head, *_grouped(FSDP, ("mapped", "ignored", "noop"))]
    return "\n".join(
        [
            "Top-level keys:",
            "",
            *rows,
            "",
            "A `datasets:` / `pretraining_dataset:` entry:",
            "",
            *nested,
            "",
            "`fsdp_config` (Axolotl's legacy `fsdp_` prefix is dropped first):",
            "",
            *fsdp,
        ]
    )


def page_block() -> str:
    """What docs/axolotl.md holds between the markers: the summary, then every key."""
    return summary_table() + "\n\n" + docs_table()


def replace_block(text: str, block: str) -> str:
    """``text`` with the part between the markers replaced by ``block``."""
    start, end = text.index(BEGIN) + len(BEGIN), text.index(END)
    return text[:start] + "\n" + block + "\n" + text[end:]


def current_block(text: str) -> str:
    return text[text.index(BEGIN) + len(BEGIN) : text.index(END)].strip("\n")


def main(root: str = ".") -> int:
    path = Path(root) / "docs" / "axolotl.md"
    path.write_text(replace_block(path.read_text(), page_block()))
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
