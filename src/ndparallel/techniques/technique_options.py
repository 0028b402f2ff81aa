"""Options of the training techniques (``ndparallel.techniques``), as small dataclasses (documented
fields, no logic); ``parallel/options.py``'s ``StrategyOptions`` holds one of each."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

LossReduction = Literal["global_token_mean", "micro_batch_mean"]
"""How a step's token losses make its loss (the YAML's ``loss_reduction``; a training-step argument,
not an engine option): the global batch's token mean, or Axolotl's mean of the micro-batches' own
token means (``techniques/loss.py``)."""
PIPELINE_MICRO_BATCH_MEAN = (
    "loss_reduction: micro_batch_mean under pipeline parallel needs one micro-batch per step: set "
    "gradient_accumulation_steps: 1 (a larger micro_batch_size), or loss_reduction: global_token_mean"
)
"""The pipeline joins a step's micro-batches into one batch, under one token-count divisor."""


@dataclass(frozen=True)
class LossOptions:
    chunked: bool | None = None
    """Compute the causal-LM loss from the final hidden states and the LM-head weight in chunks of
    tokens, never holding the full (tokens × vocab) logits. ``None`` (default): on for model
    families whose logits are exactly ``lm_head(hidden)`` (no soft-capping or scaling), off
    otherwise; ``True``: required (an error where it would not be exact); ``False``: off."""
    chunk_tokens: int | None = None
    """Tokens per chunk; default: as many as fit 256 MiB of fp32 logits (vocab/tp wide)."""


@dataclass(frozen=True)
class CompileOptions:
    enabled: bool = False
    """``torch.compile`` each decoder layer (regional compilation, as torchtitan does): one graph
    reused by every layer; FSDP2's hooks and the CP attention run outside the compiled code, TP's
    DTensor ops inside it (``techniques/compile.py``)."""
    backend: str = "inductor"
    """The ``torch.compile`` backend."""
    fullgraph: bool = False
    """Fail on graph breaks instead of falling back to eager for the broken part."""


@dataclass(frozen=True)
class Float8Options:
    enabled: bool = False
    """Train the decoder layers' linears in float8 (torchao ``Float8Linear``): needs a GPU with
    compute capability >= 8.9 (H100/H200, L40S, RTX 4090) and ``pip install ndparallel[fp8]``."""
    recipe: Literal["tensorwise", "rowwise"] = "tensorwise"
    """torchao scaling recipe: one scale per tensor (fastest, fp8 FSDP all-gather) or per row."""
    fsdp_float8_all_gather: bool = True
    """Under FSDP with the tensorwise recipe, all-gather weights in float8 (half the bytes)."""
    emulate: bool = False
    """Emulate the float8 matmuls in high precision (any device; for tests, not for speed)."""


@dataclass(frozen=True)
class QATOptions:
    """Quantisation-aware training (Axolotl's ``qat:``; ``techniques/qat.py``): torchao fake-quantises
    every linear layer's weight (and input activations) in the forward, training stays in full
    precision; the saved model keeps the unquantised weights (quantise it afterwards)."""

    weight_dtype: Literal["int4", "int8", "float8", "nvfp4", "mxfp4"] | None = None
    """The fake-quantised weight format; None: QAT off."""
    activation_dtype: Literal["int4", "int8", "float8", "nvfp4", "mxfp4"] | None = None
    """The fake-quantised input-activation format; None: weights only."""
    group_size: int | None = 32
    """Weight values per quantisation group (int4; nvfp4 16, mxfp4 32)."""
    quantize_embedding: bool = False
    """Also fake-quantise the input embedding's weight (weights only)."""
    fake_quant_after_n_steps: int | None = None
    """Train the first N optimizer steps without fake quantisation (int / float8 formats)."""

    @property
    def enabled(self) -> bool:
        return self.weight_dtype is not None

    def active_at(self, step: int) -> bool:
        """Whether fake quantisation is on in optimizer step ``step`` (1-based)."""
        return self.fake_quant_after_n_steps is None or step > self.fake_quant_after_n_steps
