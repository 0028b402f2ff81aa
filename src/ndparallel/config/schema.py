"""The typed run configuration: every field of ``ndparallel train``, validated by pydantic, and
what the run's parts are built from (``parallelism_config``, ``strategy_options``, ``data_options``,
``lora_config``). Field names are Axolotl's where Axolotl has one; the YAML front door
(``ndparallel.axolotl``) reads the file and translates Axolotl's other keys into these fields.

Errors come out as one line naming the field and the fix (unknown keys get a did-you-mean). Every
numeric field has its allowed range in the schema (``Field(ge=..., gt=..., lt=...)``; floats must
be finite); the message states the range, the value given and, where one helps, the fix.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    AliasChoices,
    Field,
    PrivateAttr,
    field_validator,
    model_validator,
)

from ndparallel.config.base import _int
from ndparallel.config.datasets import DatasetConfig, SpecialTokens
from ndparallel.config.fields import (
    ClusterFields,
    DataSourceFields,
    FSDPConfig,
    InputForms,
    LoraExtraFields,
    PrecisionFields,
    RunControlFields,
    TrackerFields,
)
from ndparallel.config.pipeline_fields import PipelineFields
from ndparallel.config.quant import QuantFields
from ndparallel.layout.config import ParallelismConfig
from ndparallel.layout.dim_handlers import CP_STRATEGIES
from ndparallel.optim.names import OptimizerName
from ndparallel.parallel.options import (
    ActivationOptions,
    CPOptions,
    FSDPOptions,
    StrategyOptions,
    TPOptions,
)
from ndparallel.techniques.technique_options import (
    PIPELINE_MICRO_BATCH_MEAN,
    CompileOptions,
    Float8Options,
    LossOptions,
    LossReduction,
)


def _float(**bounds):
    return Annotated[float, Field(allow_inf_nan=False, **bounds)]


class TrainConfig(
    InputForms,
    DataSourceFields,
    RunControlFields,
    TrackerFields,
    QuantFields,
    ClusterFields,
    PrecisionFields,
    LoraExtraFields,
    PipelineFields,
):
    """Every field of ``ndparallel train`` YAML files (Axolotl names where Axolotl has one; the
    quantisation fields: ``quant.QuantFields``; preemption and asynchronous checkpoints:
    ``fields.ClusterFields``)."""

    # model
    base_model: str = "quickstart-llama"
    """An HF model directory (or hub id when online), or a built-in preset name."""
    tokenizer: str | None = None
    """Tokenizer dir; default: base_model's, or a BPE trained on the built-in corpus for presets."""
    tokenizer_vocab_size: _int(259) = 1024
    """Vocabulary of the built-in BPE tokenizer (presets only)."""
    trust_remote_code: bool = False
    overrides_of_model_config: dict[str, Any] | None = None
    """Axolotl's field: set on the model's config before it is built, e.g. ``{output_router_logits:
    true, router_aux_loss_coef: 0.001}`` to train a mixture-of-experts model with its routers'
    load-balancing loss (docs/moe.md)."""
    attn_implementation: (
        Literal["eager", "sdpa", "flash_attention_2", "flash_attention_3", "flex_attention"] | None
    ) = None
    """Attention kernel (default: the family's own, sdpa where transformers supports it, else eager);
    one this machine lacks (e.g. flash_attention_2 on CPU) falls back to sdpa with one warning line.
    Under CP (and TP with sequence_parallel), ndparallel's own attention is used."""
    flash_attention: bool | None = None
    """Axolotl's switch: true = attn_implementation: flash_attention_2."""
    sdp_attention: bool | None = None
    """Axolotl's switch: true = attn_implementation: sdpa."""
    # layout
    dp_replicate_size: int = 1
    dp_shard_size: int = 1
    tensor_parallel_size: int = Field(1, validation_alias=AliasChoices("tensor_parallel_size", "tp_size"))
    context_parallel_size: int = Field(1, validation_alias=AliasChoices("context_parallel_size", "cp_size"))
    expert_parallel_size: int = Field(1, validation_alias=AliasChoices("expert_parallel_size", "ep_size"))
    """Mixture-of-experts models: experts split over this many ranks (Axolotl's name); carved out
    of dp_shard × cp × tp, adds no rank (docs/moe.md)."""
    fsdp_config: FSDPConfig = Field(default_factory=FSDPConfig)
    fsdp_version: int = 2
    """Only FSDP2 (per-parameter sharding on the DeviceMesh) exists here."""
    tp_plan: dict[str, str] | None = None
    sequence_parallel: bool = False
    loss_parallel: bool | None = None
    """Under TP: cross-entropy on vocab-sharded logits; default (null): on when exact."""
    cp_comm_strategy: Literal["ring", "allgather", "ulysses", "alltoall"] = "ring"
    """ring (K/V rotated), allgather (K/V gathered once per layer), ulysses (heads <-> sequence
    all-to-all); alltoall is Accelerate's name for the rotating exchange: it runs the ring."""
    # speed
    chunked_loss: bool | None = None
    """Loss from hidden states + LM-head weight in token chunks, never the full logits; default
    (null): on for model families where it is exact (see docs/performance.md)."""
    loss_chunk_tokens: _int(1) | None = None
    """Tokens per loss chunk; default: 256 MiB of fp32 logits per chunk."""
    compile: bool = False
    """torch.compile each decoder layer (regional compilation)."""
    compile_backend: str = "inductor"
    fp8: bool = False
    """Float8 training of the decoder linears (torchao; GPU compute capability >= 8.9)."""
    fp8_recipe: Literal["tensorwise", "rowwise"] = "tensorwise"
    fp8_emulate: bool = False
    """Emulate float8 matmuls in high precision (any device; testing only)."""
    # long context (Axolotl's names; docs/long_context.md)
    tiled_mlp: bool = False
    """Run each decoder MLP over sequence tiles, recomputing a tile in backward: its tokens ×
    intermediate activations never exist whole; the RMSNorms of HF's Llama form save only their input
    and rstd and run their backward over token tiles (the same output)."""
    tiled_mlp_num_shards: _int(1) | None = None
    """Tiles per MLP call; default: ceil(local tokens / hidden size)."""
    activation_offloading: bool = False
    """With fsdp_config.activation_checkpointing: each layer's checkpointed input goes to pinned host
    memory in the forward and comes back, one layer ahead, for its backward (side CUDA stream).
    'hidden_states' (Axolotl's mode offloading the checkpointed hidden states) is the same."""
    # adapter (LoRA through PEFT; Axolotl's names)
    adapter: Literal["lora", "qlora"] | None = None
    """'lora': train LoRA adapters on the frozen base model (needs peft: pip install
    'ndparallel[lora]'); 'qlora' (with load_in_4bit: true): the same on a 4-bit NF4 base (torchao);
    null: full fine-tuning."""
    lora_r: _int(1) = 8
    lora_alpha: _float(gt=0) = 16.0
    lora_dropout: _float(ge=0, lt=1) = 0.0
    """Dropout on the adapter input; its random mask differs between layouts (use 0 to compare them)."""
    lora_target_modules: str | list[str] | None = Field(
        None, validation_alias=AliasChoices("lora_target_modules", "target_modules")
    )
    """Module names to adapt (e.g. [q_proj, v_proj]); none and no lora_target_linear: PEFT's default."""
    lora_target_linear: bool = False
    """Adapt every linear layer except the output head (added to lora_target_modules)."""
    peft_use_rslora: bool = False
    """Rank-stabilised LoRA: scale the adapter by alpha / sqrt(r) instead of alpha / r."""
    lora_model_dir: str | None = None
    """A saved PEFT LoRA adapter (adapter_config.json + adapter_model.safetensors) to continue
    training: its r, alpha and targets are used and its weights replace the fresh init."""
    merge_lora: bool = False
    """Also write the base model with the adapter merged in, to output_dir/merged."""
    # data
    datasets: list[DatasetConfig] | None = None
    """Required with a real base_model; a built-in preset defaults to the built-in corpus."""
    val_set_size: _float(ge=0) = 0.0
    """A fraction in [0, 1) of the packed blocks, or a whole number of blocks."""
    sequence_len: int = 256
    sample_packing: bool | None = None
    """true: whole samples packed into rows (attention per sample); false: one sample per row; unset:
    raw text is concatenated and cut into blocks, fine-tuning data as false."""
    pad_to_sequence_len: bool | None = None
    """true: rows always sequence_len long (fixed shapes); false: each micro-batch cut after its
    longest row (rounded up to what the layout needs; bucketed under compile, fp8 and pipeline
    parallel); unset: true with sample_packing, false without (Axolotl's default)."""
    train_on_inputs: bool = False
    """Train on the prompt too (default: its labels are -100, only the answer is learned)."""
    excess_length_strategy: Literal["truncate", "drop", "raise"] = "drop"
    """A fine-tuning sample longer than sequence_len: dropped (Axolotl's default; the count is said
    before launch), truncated (an answer cut with no eos) or refused. Raw text is cut into pieces."""
    chat_template: str | None = None
    """Template of chat_template datasets: tokenizer_default (default), one of Axolotl's named templates
    (chatml, llama3, qwen3, gemma3, phi_3, mistral_v7_tekken, ...: ``data/chat_templates``), or jinja."""
    chat_template_jinja: str | None = None
    """A Jinja chat template (text or a .jinja file) for chat_template: jinja."""
    eot_tokens: list[str] | None = None
    """Tokens that end a chat turn, besides the eos (default: only the eos, as in Axolotl: a template
    ending turns with another token, such as ChatML's <|im_end|> under a base model's eos, then trains
    no turn end, said before launch); trained per each dataset's train_on_eot."""
    special_tokens: SpecialTokens | None = None
    """bos/eos/pad/unk tokens set on the tokenizer; one not in its vocabulary is added (new row)."""
    tokens: list[str] | None = None
    """Tokens added to the tokenizer; each new one gets an embedding (and LM-head) row initialised to
    the mean of the existing rows, trained with the model (full fine-tuning only)."""
    resize_token_embeddings_to_32x: bool = False
    """When rows are added, round the vocabulary up to a multiple of 32."""
    dataset_cache_dir: str | None = None
    """Tokenized data, rows and the built-in tokenizer (default: output_dir/../.cache)."""
    dataset_processes: _int(1) | None = None
    """Processes that tokenize (datasets.map num_proc); default 1."""
    # optimisation
    micro_batch_size: _int(1) = 1
    gradient_accumulation_steps: _int(1) = 1
    num_epochs: _float(gt=0) = 1.0
    max_steps: _int(1) | None = None
    """Optimizer steps; when set, num_epochs is ignored (as in HF Trainer and Axolotl; train says so)."""
    learning_rate: _float(gt=0) = 3e-4
    lr_scheduler: Literal["cosine", "linear", "constant", "constant_with_warmup"] = "cosine"
    """constant and constant_with_warmup are the same: constant after the warm-up."""
    warmup_steps: _int(0) = 0
    warmup_ratio: _float(ge=0, lt=1) | None = None
    """Warm-up as a fraction of the run's steps (rounded up); instead of warmup_steps."""
    optimizer: OptimizerName = "adamw"
    """adamw_torch_fused: AdamW with torch's fused kernel where every parameter is on CUDA; adamw_8bit
    (adamw_bnb_8bit, paged_adamw_8bit, adamw_torch_8bit), adamw_torch_4bit, ao_adamw_fp8: torchao's
    low-bit AdamW (optim/lowbit.py)."""
    weight_decay: _float(ge=0) = 0.0
    adam_beta1: _float(ge=0, lt=1) = 0.9
    adam_beta2: _float(ge=0, lt=1) = 0.999
    adam_epsilon: _float(gt=0) = 1e-8
    max_grad_norm: _float(gt=0) | None = 1.0
    loss_reduction: LossReduction = "global_token_mean"
    """A step's loss (and gradient): global_token_mean, its token losses' sum / its trained tokens
    (every micro-batch and rank: the same whatever the split); micro_batch_mean, the mean of each dp
    rank's micro-batches' own token means (Axolotl's; it depends on the split, docs/axolotl.md;
    under pipeline parallel only without accumulation). Evaluation keeps the token mean."""
    on_nonfinite: Literal["stop", "skip"] = "stop"
    """A NaN/inf loss or gradient norm: stop naming the step (at the next log step, before any save),
    or skip that optimizer step (costs one host sync per step)."""
    bf16: bool = False
    tf32: bool = False
    """TF32 matmuls on CUDA (fp32 inputs, 10-bit mantissa products); no effect on CPU."""
    seed: _int(0) = 42
    # output, logging, checkpoints
    output_dir: str = "outputs/run"
    overwrite_output_dir: bool = False
    """Start a new run in an output_dir that holds a previous run: that run's files are replaced.
    Files no ndparallel run wrote are never deleted or overwritten."""
    logging_steps: _int(1) = 1
    eval_steps: _int(1) | None = None
    save_steps: _int(1) | None = None
    saves_per_epoch: _int(1) | None = None
    """Checkpoints per epoch (every steps_per_epoch // saves_per_epoch steps); instead of save_steps."""
    save_total_limit: _int(1) | None = None
    resume_from_checkpoint: str | None = None
    save_final_model: bool = True
    save_dtype: Literal["auto", "bf16", "fp32", "fp16"] = "auto"
    """dtype of the final model's weights: auto = the compute dtype (bf16 / fp16 run), else fp32."""
    # runtime
    device: Literal["auto", "cpu", "cuda"] = "auto"
    _axolotl_notes: list[str] = PrivateAttr(
        default_factory=list
    )  # what the front door translated (axolotl/translate.py)
    collective_timeout_s: _float(gt=0) = 600.0
    max_restarts: _int(0) = 0

    @field_validator(
        "dp_replicate_size",
        "dp_shard_size",
        "tensor_parallel_size",
        "context_parallel_size",
        "expert_parallel_size",
    )
    @classmethod
    def _degree(cls, v: int, info) -> int:
        if v == -1 and info.field_name in ("dp_replicate_size", "dp_shard_size"):
            return v
        if v < 1:
            raise ValueError(f"must be >= 1 (1 disables the dimension), got {v}")
        return v

    @field_validator("fsdp_version")
    @classmethod
    def _fsdp2(cls, v: int) -> int:
        if v != 2:
            raise ValueError(f"only FSDP2 exists here, got {v}; set fsdp_version: 2 or remove it")
        return v

    @model_validator(mode="after")
    def _one_way_each(self):
        pairs = [("warmup_steps", "warmup_ratio"), ("save_steps", "saves_per_epoch")]
        for a, b in pairs:
            if a in self.model_fields_set and getattr(self, b) is not None:
                raise ValueError(f"'{a}' and '{b}' are both set; keep one")
        for flag, impl in (("flash_attention", "flash_attention_2"), ("sdp_attention", "sdpa")):
            if getattr(self, flag):
                if self.attn_implementation not in (None, impl):
                    raise ValueError(
                        f"'{flag}: true' and 'attn_implementation: {self.attn_implementation}' "
                        "disagree; keep one"
                    )
                self.attn_implementation = impl
        if self.activation_offloading and not self.fsdp_config.activation_checkpointing:
            raise ValueError(
                "activation_offloading offloads what activation checkpointing keeps: set "
                "fsdp_config.activation_checkpointing: true, or remove activation_offloading"
            )
        pipelined = self.pipeline_parallel_size > 1 and self.gradient_accumulation_steps > 1
        if self.loss_reduction == "micro_batch_mean" and pipelined:
            raise ValueError(PIPELINE_MICRO_BATCH_MEAN)
        if self.tiled_mlp_num_shards is not None and not self.tiled_mlp:
            raise ValueError(
                "tiled_mlp_num_shards is set but tiled_mlp is not: set tiled_mlp: true, or "
                "remove tiled_mlp_num_shards"
            )
        return self

    @field_validator("activation_offloading", mode="before")
    @classmethod
    def _offload_mode(cls, v):
        if v == "hidden_states":
            return True
        if isinstance(v, str) and v.lower() in ("legacy", "disk", "offload", "offload_disk"):
            raise ValueError(
                f"{v!r} is not supported: ndparallel offloads the checkpointed hidden states to "
                "pinned host memory on a side stream; use true (or hidden_states)"
            )
        return v

    @field_validator("lora_target_modules", mode="before")
    @classmethod
    def _target_list(cls, v):
        """A list of module names; one string is a regular expression matched against whole module
        names (PEFT's and Axolotl's rule) when it has regex characters, else one name."""
        return v if not isinstance(v, str) or set(v) & set("[]()*+?|\\^$") else [v]

    @field_validator("sequence_len")
    @classmethod
    def _positive(cls, v: int | None) -> int | None:
        if v is not None and v < 1:
            raise ValueError(f"must be >= 1, got {v}")
        return v

    @field_validator("val_set_size")
    @classmethod
    def _fraction_or_count(cls, v: float) -> float:
        if v >= 1 and not float(v).is_integer():
            raise ValueError(f"must be a fraction in [0, 1) or a whole number of blocks, got {v}")
        return v

    # ------------------------------------------------------------ derived
    def parallelism_config(self) -> ParallelismConfig:
        return ParallelismConfig(
            dp_replicate_size=self.dp_replicate_size,
            dp_shard_size=self.dp_shard_size,
            tp_size=self.tensor_parallel_size,
            cp_size=self.context_parallel_size,
            ep_size=self.expert_parallel_size,
            pp_size=self.pipeline_parallel_size,
        )

    def fsdp_options(self) -> FSDPOptions:
        return self.fsdp_config.options()

    def activation_options(self) -> ActivationOptions:
        """Checkpointing (Axolotl's place: ``fsdp_config``) and the long-context fields."""
        return ActivationOptions(
            activation_checkpointing=self.fsdp_config.activation_checkpointing,
            ac_policy=self.fsdp_config.ac_policy,
            activation_offloading=bool(self.activation_offloading),
            tiled_mlp=self.tiled_mlp,
            tiled_mlp_num_shards=self.tiled_mlp_num_shards,
        )

    def tp_options(self) -> TPOptions:
        return TPOptions(
            plan=self.tp_plan, sequence_parallel=self.sequence_parallel, loss_parallel=self.loss_parallel
        )

    def export_dtype(self):
        import torch

        name = self.save_dtype if self.save_dtype != "auto" else self.compute_dtype_name()
        return {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}[name]

    def cp_options(self) -> CPOptions:

        return CPOptions(comm_strategy=CP_STRATEGIES.get(self.cp_comm_strategy, self.cp_comm_strategy))

    def loss_options(self) -> LossOptions:
        return LossOptions(chunked=self.chunked_loss, chunk_tokens=self.loss_chunk_tokens)

    def compile_options(self) -> CompileOptions:
        return CompileOptions(enabled=self.compile, backend=self.compile_backend)

    def float8_options(self) -> Float8Options:
        return Float8Options(enabled=self.fp8, recipe=self.fp8_recipe, emulate=self.fp8_emulate)

    def strategy_options(self) -> StrategyOptions:
        """Every strategy option of the run, and its compute dtype: what the engine applies."""
        return StrategyOptions(
            fsdp=self.fsdp_options(),
            activation=self.activation_options(),
            tp=self.tp_options(),
            cp=self.cp_options(),
            loss=self.loss_options(),
            compile=self.compile_options(),
            float8=self.float8_options(),
            qat=self.qat_options(),
            pipeline=self.pipeline_options(),
            param_dtype=self.compute_dtype(),
        )

    def lora_kwargs(self, **overrides) -> dict | None:
        """Arguments of ``ndparallel.models.adapters.lora_config``; None without ``adapter``."""
        if self.adapter is None:
            return None
        return {
            "r": self.lora_r,
            "alpha": self.lora_alpha,
            "dropout": self.lora_dropout,
            "target_modules": self.lora_target_modules,
            "target_linear": self.lora_target_linear,
            **({"use_rslora": True} if self.peft_use_rslora else {}),
            **({"revision": self.revision_of_model} if self.revision_of_model else {}),
            **self.lora_extra_kwargs(),
            **overrides,
        }

    def lora_config(self):
        """The peft ``LoraConfig`` of ``adapter: lora`` (None without it): the one saved in
        ``lora_model_dir`` if set, else the one the ``lora_*`` fields describe."""
        if self.adapter is not None and self.lora_model_dir:
            from ndparallel.models.adapter_files import read_adapter_config  # imports torch: when asked

            dropout = self.lora_dropout if "lora_dropout" in self.model_fields_set else None
            return read_adapter_config(self.lora_model_dir, dropout=dropout)
        return self.lora_config_from_fields()

    def lora_config_from_fields(self):
        """The peft ``LoraConfig`` the ``lora_*`` fields describe (None without ``adapter``)."""

        from ndparallel.models.adapters import lora_config  # imports torch and peft: when asked

        kwargs = self.lora_kwargs()
        return lora_config(**kwargs) if kwargs is not None else None

    def lora_fields_without_adapter(self) -> list[str]:
        """LoRA fields the user set although ``adapter`` is not ``lora``."""
        if self.adapter is not None:
            return []
        fields = type(self).model_fields
        return sorted(
            f
            for f in self.model_fields_set
            if (f.startswith("lora_") or f == "merge_lora")
            and getattr(self, f) not in (None, False, "", [])
            and getattr(self, f) != fields[f].default
        )

    def pads_to_sequence_len(self) -> bool:
        """``pad_to_sequence_len`` as set, else Axolotl's default: true with ``sample_packing``."""
        if self.pad_to_sequence_len is not None:
            return self.pad_to_sequence_len
        return bool(self.sample_packing)

    def data_options(self):
        from ndparallel.data.prepare import DataOptions

        return DataOptions(
            sequence_len=self.sequence_len,
            sample_packing=self.sample_packing,
            train_on_inputs=self.train_on_inputs,
            excess_length_strategy=self.excess_length_strategy,
            chat_template=self.chat_template,
            eot_tokens=tuple(self.eot_tokens or ()) or None,
            chat_template_jinja=self.chat_template_jinja,
            chat_template_kwargs=self.chat_template_kwargs,
            min_sample_len=self.min_sample_len,
            val_set_size=self.val_set_size,
            seed=self.seed,
            num_proc=self.dataset_processes,
            deduplicate=self.dataset_exact_deduplication,
            sequential_packing=self.sample_packing_sequentially,
            multipack=self.sample_packing_order == "multipack",
            boundary_targets=self.sample_packing_boundary_targets,
            shuffle_merged=self.shuffle_merged_datasets
            and not (self.curriculum_sampling and len(self.datasets or ()) == 1),
        )
