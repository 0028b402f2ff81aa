"""Groups of training-config fields: ``fsdp_config``'s section, and what ``TrainConfig``
(``schema.py``) inherits: experiment trackers, and Axolotl's run controls (evaluation and saving
cadence, early stopping, the loss watchdog, the cosine floor, frozen parameters, sample filters)."""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import AliasChoices, Field, field_validator, model_validator

from ndparallel.config.base import _int, _Strict
from ndparallel.config.datasets import DatasetConfig
from ndparallel.models.presets import is_preset
from ndparallel.parallel.options import FSDPOptions


class FSDPConfig(_Strict):
    reshard_after_forward: bool = True
    cpu_offload: bool = False
    activation_checkpointing: bool = False
    ac_policy: Literal["full", "selective"] = "full"
    """With activation_checkpointing: 'full' recomputes each decoder layer; 'selective' only the
    norms and the MLP activation (Megatron's selective scheme; docs/long_context.md)."""
    unsharded_grad_accumulation: bool | None = None
    """None: one gradient reduction per step under pipeline parallel, every micro-batch otherwise."""
    layer_classes: list[str] | None = None
    """Decoder-layer class names FSDP wraps one by one (default: found in the model)."""
    # Axolotl / Accelerate names with one meaning here (compat.py explains them in --dry-run)
    state_dict_type: Literal["FULL_STATE_DICT", "SHARDED_STATE_DICT"] | None = None
    auto_wrap_policy: Literal["TRANSFORMER_BASED_WRAP", "SIZE_BASED_WRAP"] | None = None

    def options(self) -> FSDPOptions:
        """The runtime's ``FSDPOptions`` of this section (its checkpointing fields are
        ``ActivationOptions``': ``TrainConfig.activation_options``)."""
        return FSDPOptions(
            reshard_after_forward=self.reshard_after_forward,
            cpu_offload=self.cpu_offload,
            unsharded_grad_accumulation=self.unsharded_grad_accumulation,
            layer_classes=tuple(self.layer_classes) if self.layer_classes else None,
        )

    @staticmethod
    def runnable(section: dict) -> dict:
        """An ``fsdp_config`` mapping (YAML) without the policy its checkpointing no longer has (a
        policy needs checkpointing: ``_policy_needs_checkpointing``); ``plan --write-config``'s merge."""
        if not section.get("activation_checkpointing"):
            section.pop("ac_policy", None)
        return section

    @field_validator("layer_classes", mode="before")
    @classmethod
    def _one_or_more(cls, v):
        """A list, one name, or Accelerate's comma-separated names (``A,B``)."""
        names = [v] if isinstance(v, str) else v
        return [n.strip() for name in names for n in str(name).split(",") if n.strip()] if names else v

    @model_validator(mode="after")
    def _policy_needs_checkpointing(self):
        if self.ac_policy != "full" and not self.activation_checkpointing:
            raise ValueError(
                f"ac_policy: {self.ac_policy} chooses what activation checkpointing recomputes: set "
                "activation_checkpointing: true, or remove ac_policy"
            )
        return self

    @field_validator("auto_wrap_policy", mode="before")
    @classmethod
    def _wrap_policy(cls, v):
        if v is not None and v not in ("TRANSFORMER_BASED_WRAP", "SIZE_BASED_WRAP"):
            raise ValueError(
                f"{v!r} is not supported: ndparallel wraps each decoder layer "
                "(TRANSFORMER_BASED_WRAP); remove it or set TRANSFORMER_BASED_WRAP"
            )
        return v


class TrackerFields(_Strict):
    """Where metrics go besides ``output_dir/metrics.jsonl`` (Axolotl's names)."""

    use_wandb: bool | None = None
    """Weights & Biases; on when wandb_project is set (as in Axolotl)."""
    wandb_project: str | None = None
    wandb_entity: str | None = None
    wandb_name: str | None = None
    wandb_run_id: str | None = None
    wandb_mode: Literal["online", "offline", "disabled", "shared"] | None = None
    """offline: the run is written under output_dir/wandb (``wandb sync`` uploads it later)."""
    wandb_watch: str | None = None
    wandb_log_model: str | None = None
    use_tensorboard: bool = False
    """TensorBoard event files under output_dir/runs."""
    use_mlflow: bool | None = None
    """MLflow; on when mlflow_tracking_uri or mlflow_experiment_name is set (as in Axolotl)."""
    mlflow_tracking_uri: str | None = None
    mlflow_experiment_name: str | None = None
    mlflow_run_name: str | None = None
    hf_mlflow_log_artifacts: bool | None = None
    use_swanlab: bool | None = None
    """SwanLab; on when swanlab_project is set."""
    swanlab_project: str | None = None
    swanlab_experiment_name: str | None = None
    swanlab_description: str | None = None
    swanlab_workspace: str | None = None
    swanlab_mode: Literal["cloud", "online", "local", "offline", "disabled"] | None = None
    """offline: the run is written under output_dir/swanlog (``swanlab sync`` uploads it later)."""
    use_otel_metrics: bool = False
    """A Prometheus endpoint http://otel_metrics_host:otel_metrics_port/metrics (main rank) with the
    latest logged numbers (Axolotl's OpenTelemetry metrics)."""
    otel_metrics_host: str = "localhost"
    otel_metrics_port: int = Field(8000, ge=0, le=65535)

    @field_validator("wandb_watch", "wandb_log_model")
    @classmethod
    def _unsupported_wandb(cls, v, info):
        if v not in (None, "", "false", "False"):
            what = "watching gradients" if info.field_name == "wandb_watch" else "uploading the model"
            raise ValueError(f"{v!r}: {what} to W&B is not supported; remove it (metrics are logged)")
        return None

    @field_validator("hf_mlflow_log_artifacts")
    @classmethod
    def _no_artifacts(cls, v):
        if v:
            raise ValueError("copying checkpoints to MLflow is not supported; remove it (metrics are logged)")
        return v

    def trackers(self) -> list[str]:
        """The trackers this config turns on, by name (``ndparallel.tracking``)."""
        out = []
        wandb = self.use_wandb if self.use_wandb is not None else bool(self.wandb_project)
        if wandb and self.wandb_mode != "disabled":
            out.append("wandb")
        if self.use_tensorboard:
            out.append("tensorboard")
        mlflow = (
            self.use_mlflow
            if self.use_mlflow is not None
            else bool(self.mlflow_tracking_uri or self.mlflow_experiment_name)
        )
        if mlflow:
            out.append("mlflow")
        swanlab = self.use_swanlab if self.use_swanlab is not None else bool(self.swanlab_project)
        if swanlab and self.swanlab_mode != "disabled":
            out.append("swanlab")
        if self.use_otel_metrics:
            out.append("prometheus")
        return out

    def tracker_kwargs(self, name: str, run_dir: str) -> dict[str, Any]:
        """Arguments of tracker ``name`` for a run writing to ``run_dir``."""
        if name == "wandb":
            return {
                k: v
                for k, v in {
                    "project": self.wandb_project or "ndparallel",
                    "entity": self.wandb_entity,
                    "name": self.wandb_name,
                    "id": self.wandb_run_id,
                    "mode": self.wandb_mode,
                    "dir": run_dir,
                }.items()
                if v is not None
            }
        if name == "tensorboard":
            return {"logging_dir": f"{run_dir}/runs"}
        if name == "prometheus":
            return {"host": self.otel_metrics_host, "port": self.otel_metrics_port}
        if name == "swanlab":  # Axolotl's "cloud" is SwanLab's "online"
            mode = "online" if self.swanlab_mode == "cloud" else self.swanlab_mode
            return {
                k: v
                for k, v in {
                    "project": self.swanlab_project or "ndparallel",
                    "mode": mode,
                    "name": self.swanlab_experiment_name,
                    "description": self.swanlab_description,
                    "workspace": self.swanlab_workspace,
                    "log_dir": f"{run_dir}/swanlog",
                }.items()
                if v is not None
            }
        return {
            k: v
            for k, v in {
                "experiment_name": self.mlflow_experiment_name or "ndparallel",
                "tracking_uri": self.mlflow_tracking_uri,
                "run_name": self.mlflow_run_name,
            }.items()
            if v is not None
        }


class ClusterFields(_Strict):
    """Preemption and asynchronous checkpoints (``docs/multi_node.md``, ``docs/checkpoints.md``)."""

    checkpoint_async: bool = False
    """Write checkpoints in the background (staged to host memory, pinned on CUDA) while training
    continues; at most one in flight, COMPLETE only once written, the last one awaited at the end."""
    preemption_checkpoint: bool = True
    """On SIGTERM / SIGUSR1 (preemption, scancel, SLURM's --signal): finish the step, save a
    checkpoint there and exit 75; false: exit 75 without saving."""
    preemption_timeout_s: float = Field(100.0, gt=0, allow_inf_nan=False)
    """Seconds from the signal until the job exits even without a checkpoint (keep it below the
    scheduler's grace period: SLURM --signal lead time / KillWait, Kubernetes
    terminationGracePeriodSeconds)."""


class PrecisionFields(_Strict):
    """fp16 mixed precision and its dynamic loss scaling (``docs/precision.md``); ``bf16`` is in
    ``TrainConfig``."""

    fp16: bool = False
    """fp16 compute (FSDP2's param_dtype) with fp32 master weights, fp32 gradient reduction and
    dynamic loss scaling; for GPUs without bf16 (V100, T4). bf16 needs no scaling: prefer it."""
    loss_scale_init: float = Field(2.0**16, gt=0, allow_inf_nan=False)
    """fp16: the first loss scale (a power of two keeps scaling exact)."""
    loss_scale_growth_interval: int = Field(2000, ge=1)
    """fp16: finite steps in a row after which the loss scale doubles (an overflow halves it and
    skips that optimizer step)."""
    loss_scale_min: float = Field(1.0, gt=0, allow_inf_nan=False)
    """fp16: a loss scale halved below this stops the run (the gradients overflow at any scale)."""

    @model_validator(mode="after")
    def _one_precision(self):
        if self.fp16 and getattr(self, "bf16", False):
            raise ValueError(
                "bf16 and fp16 are both true: choose one (bf16 where the GPU has it: no loss scaling)"
            )
        if self.fp16 and getattr(self, "fp8", False):
            raise ValueError(
                "fp8 with fp16 is not supported (torchao's float8 training runs from bf16/fp32): "
                "use bf16: true with fp8: true"
            )
        return self

    def compute_dtype_name(self) -> str:
        """ "bf16", "fp16" (mixed precision, fp32 master weights) or "fp32"."""
        return "bf16" if getattr(self, "bf16", False) else "fp16" if self.fp16 else "fp32"

    def compute_dtype(self):
        """The torch dtype of mixed-precision compute (``StrategyOptions.param_dtype``); None: fp32."""
        import torch

        return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(self.compute_dtype_name())

    def loss_scaler(self):
        """The ``LossScaler`` of an fp16 run, None otherwise."""
        if not self.fp16:
            return None
        from ndparallel.engine.loss_scale import LossScaler

        return LossScaler(
            self.loss_scale_init,
            growth_interval=self.loss_scale_growth_interval,
            min_scale=self.loss_scale_min,
        )


class RunControlFields(_Strict):
    """Axolotl's cadence, stopping and selection settings that ndparallel honours."""

    evals_per_epoch: _int(1) | None = None
    """Evaluations per epoch (every steps_per_epoch // evals_per_epoch steps); instead of eval_steps."""
    early_stopping_patience: _int(1) | None = None
    """Stop after this many evaluations in a row without a lower eval_loss."""
    loss_watchdog_threshold: float | None = Field(None, gt=0, allow_inf_nan=False)
    """Stop when the training loss stays above this (at loss_watchdog_patience log steps in a row)."""
    loss_watchdog_patience: _int(1) = 3
    loss_watchdog_action: Literal["stop", "fail"] = "stop"
    """What the loss watchdog does: ``stop`` ends the run as Axolotl's does (a warning, the final model
    saved, exit 0); ``fail`` exits 1 at once, nothing more saved (like a diverged run)."""
    cosine_min_lr_ratio: float | None = Field(None, ge=0, le=1, allow_inf_nan=False)
    """cosine: decay to this fraction of learning_rate instead of 0."""
    cosine_constant_lr_ratio: float | None = Field(None, ge=0, le=1, allow_inf_nan=False)
    """cosine: hold the learning rate at its floor after this fraction of the steps."""
    lr_quadratic_warmup: bool = False
    """Warm up quadratically ((step / warmup_steps)^2) instead of linearly."""
    unfrozen_parameters: list[str] | None = None
    """Regular expressions (re.match on parameter names); only matching parameters are trained."""
    reinit_weights: bool = False
    """Start from base_model's architecture with random weights (pre-training from scratch)."""
    min_sample_len: _int(1) | None = None
    """Fine-tuning samples shorter than this many tokens are dropped."""
    chat_template_kwargs: dict[str, Any] | None = None
    """Extra variables for the chat template (e.g. {enable_thinking: false})."""

    @model_validator(mode="after")
    def _one_way_each(self):  # reads TrainConfig's lr_scheduler and eval_steps
        extras = [
            f
            for f in ("cosine_min_lr_ratio", "cosine_constant_lr_ratio", "lr_quadratic_warmup")
            if getattr(self, f) not in (None, False)
        ]
        if extras and self.lr_scheduler != "cosine":
            raise ValueError(
                f"{', '.join(extras)} shape the cosine schedule, but lr_scheduler is "
                f"{self.lr_scheduler}: set lr_scheduler: cosine or remove them"
            )
        if self.evals_per_epoch is not None and self.eval_steps is not None:
            raise ValueError("'eval_steps' and 'evals_per_epoch' are both set; keep one")
        return self

    @field_validator("unfrozen_parameters")
    @classmethod
    def _patterns(cls, v):
        for pattern in v or []:
            try:
                re.compile(pattern)
            except re.error as e:
                raise ValueError(f"{pattern!r} is not a regular expression ({e})") from None
        return v or None


class DataSourceFields(_Strict):
    """Where the data comes from when it is not ``datasets``: Axolotl's streamed pre-training text;
    and the rule for a config without any data."""

    pretraining_dataset: list[DatasetConfig] | None = None
    """Raw text streamed as Axolotl does (needs max_steps): tokenised, concatenated and cut into
    sequence_len blocks while training; instead of datasets."""
    revision_of_model: str | None = Field(
        None, min_length=1, validation_alias=AliasChoices("revision_of_model", "model_revision")
    )
    """A Hub base_model's branch, tag or commit (config, weights and tokenizer all from it)."""
    dataset_exact_deduplication: bool = False
    """Drop fine-tuning samples whose tokens and labels repeat an earlier sample's (Axolotl's rule)."""
    curriculum_sampling: bool = False
    """Train on the rows in dataset order every epoch (no shuffle)."""
    shuffle_merged_datasets: bool = True
    """Put the fine-tuning samples in Axolotl's order first: the datasets' examples concatenated and
    shuffled once by seed (with one dataset, not under curriculum_sampling); with the loader's
    per-epoch draw, each step sees the samples Axolotl's trainer sees (sample_packing: false)."""
    sample_packing_sequentially: bool = False
    """sample_packing: fill rows in dataset order (next fit) instead of longest first (first fit
    decreasing); with curriculum_sampling the samples are seen in the order of the data."""
    sample_packing_order: Literal["rows", "multipack"] = "rows"
    """sample_packing: rows = packed once (first fit decreasing, or next fit), each epoch drawing
    rows as unpacked samples are drawn; multipack = Axolotl's sampler: each epoch the samples drawn,
    packed first fit in that order and trained in it, so each step trains Axolotl's rows."""
    sample_packing_bin_size: int = Field(200, ge=1)
    """sample_packing_order: multipack: at most this many samples in one row (Axolotl's key)."""
    sample_packing_group_size: int = Field(100_000, ge=1)
    """sample_packing_order: multipack: samples packed at a time (Axolotl's key)."""
    multipack_real_batches: bool | None = None
    """sample_packing_order: multipack packs micro_batch_size rows of sequence_len (Axolotl's true,
    its default without a varlen kernel); Axolotl's false (one row of micro_batch_size x
    sequence_len, its default with flash or flex attention) is refused there."""
    sample_packing_boundary_targets: bool = False
    """sample_packing: train each packed sample's last token to predict the next sample's first token
    where that token is trained (Axolotl's packed rows: a completion piece, train_on_inputs); default
    false: the label across a sample boundary is -100, so packed samples train as they do alone."""

    @field_validator("revision_of_model", mode="before")
    @classmethod
    def _revision_text(cls, v):
        return (
            str(v) if isinstance(v, int) and not isinstance(v, bool) else v
        )  # YAML reads 1234567 as a number

    @model_validator(mode="after")
    def _data_source(self):  # reads TrainConfig's datasets / max_steps / base_model

        if self.pretraining_dataset is not None:
            if self.datasets:
                raise ValueError("'datasets' and 'pretraining_dataset' are both set; keep one")
            if self.max_steps is None:
                raise ValueError(
                    "pretraining_dataset is streamed: set max_steps (the stream has no known length)"
                )
            self.datasets = []
        elif not self.datasets:  # a real model without data: refused once base_model itself is checked
            self.datasets = [DatasetConfig(path="builtin:stdlib")] if is_preset(self.base_model) else []
        return self

    def missing_data_problem(self) -> str | None:
        """A real base_model and no data at all (the built-in corpus only goes with the presets)."""
        if self.datasets or self.pretraining_dataset is not None:
            return None
        return (
            f"datasets: none given for base_model={self.base_model!r}; add datasets: [{{path: "
            f"FILE_OR_HUB_NAME, "
            "type: alpaca | chat_template | completion ...}] (or pretraining_dataset:)"
        )


class InputForms(_Strict):
    """How Axolotl's configs write some of ``TrainConfig``'s fields: an empty string for "not set",
    one item for a list (validators only; the fields are TrainConfig's)."""

    @field_validator(
        "lora_model_dir", "resume_from_checkpoint", "tokenizer", mode="before", check_fields=False
    )
    @classmethod
    def _empty_is_unset(cls, v):
        return None if v == "" else v

    @field_validator("tokens", mode="before", check_fields=False)
    @classmethod
    def _token_list(cls, v):
        if isinstance(v, dict):
            raise ValueError(
                f"a list of new tokens, got a mapping {sorted(v)}: put bos/eos/pad/unk tokens under "
                "special_tokens: and list other new tokens under tokens:"
            )
        return [v] if isinstance(v, str) else v


class LoraExtraFields(_Strict):
    """LoRA's whole-module and parameter targets (with ``adapter: lora``, Axolotl's names)."""

    lora_modules_to_save: list[str] | None = None
    """Modules trained in full beside the adapters and saved with them (e.g. [embed_tokens, lm_head]);
    tied embeddings stay tied; QLoRA leaves them unquantised. Not with tensor_parallel_size > 1."""
    lora_target_parameters: list[str] | None = None
    """Parameters given LoRA directly (PEFT's target_parameters), e.g. MoE experts' 3-D
    [experts.gate_up_proj, experts.down_proj]; needs lora_dropout: 0; not with TP or EP."""

    def lora_extra_kwargs(self) -> dict:
        """These fields as ``models.adapters.lora_config`` arguments (the unset ones left out)."""
        return {
            k: v
            for k, v in (
                ("modules_to_save", self.lora_modules_to_save),
                ("target_parameters", self.lora_target_parameters),
            )
            if v
        }
