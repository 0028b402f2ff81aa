"""Train the same model on the same global batches on one process and under a layout; compare.

This is the project's central check (tests and ``ndparallel verify`` use it): with the loss
normalised by the global token count, every layout must reproduce one device's losses, gradient
norms and parameters up to fp32 rounding.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

import torch

from ndparallel import ParallelismConfig
from ndparallel.data.loader import PackedLoader
from ndparallel.data.widths import bucket_widths, width_multiple
from ndparallel.engine import Engine, LossScaler, batch_to_device, train_step
from ndparallel.models.adapters import apply_adapter, lora_config
from ndparallel.models.quantized import dequantize, is_nf4, quantize_linears
from ndparallel.optim.build import build_optimizer
from ndparallel.parallel.options import StrategyOptions
from ndparallel.parallel.pp.schedule import gather_stage_states
from ndparallel.techniques.loss import IGNORE_INDEX, causal_lm_loss


@dataclass(frozen=True)
class TrainSetup:
    """What both runs share: model config, data shape, optimizer, steps."""

    model_config: Any  # a transformers PretrainedConfig
    steps: int = 3
    global_micro_batch: int = 4  # rows of one micro-batch summed over all dp ranks
    grad_accum: int = 1
    seq_len: int = 32
    optimizer: str = "adamw"  # or "sgd", "muon", ...
    optimizer_options: dict = field(default_factory=dict)  # more keywords of build_optimizer (muon: ns_dtype)
    weight_decay: float = 0.01
    lr: float = 1e-2
    max_grad_norm: float | None = None
    loss_reduction: str = "global_token_mean"
    """The YAML's ``loss_reduction``: micro_batch_mean averages the dp ranks' micro-batches' own
    token means (Axolotl's); its one process is ``split_micro_batches`` by dp (the same micro-batches)."""
    seed: int = 0
    ignore_fraction: float = 0.1  # share of label positions set to IGNORE_INDEX
    mixed_precision: str = "no"
    parallel_kwargs: dict = field(default_factory=dict)
    """Strategy options under the Accelerator's names (``fsdp_options=``, ``tp_options=``,
    ``cp_options=``, ``loss_options=``, ``compile_options=``, ``float8_options=``)."""
    packed_documents: bool = False
    """Rows hold several documents: position_ids restart at 0 at each document start and the
    label across each boundary is ignored (transformers' packing convention)."""
    batches: list | None = None
    """Given global batches (``steps`` lists of ``grad_accum`` micro-batch dicts of
    ``global_micro_batch`` rows) instead of random tokens, e.g. rows of real packed samples."""
    rows: Any = None
    """Rows of whole samples (a ``data.rows.RowStore``) both runs read through the trainer's loader
    (``PackedLoader``, in row order), each micro-batch cut after its longest row as with
    ``pad_to_sequence_len: false``: the one process at its global micro-batch's width, each rank of
    the layout at its own rows' width, rounded up to what its layout needs (``data/widths.py``)."""
    bucketed: bool = False
    """With ``rows``: widths bucketed too (as under compile, fp8 and pipeline parallel)."""
    fault: str | None = None
    """A deliberately broken layout run of this tool's own inputs (proves the checks can fail):
    "cross-documents" gives the model position_ids without restarts, so its attention crosses
    document starts; "overflow-step-2" (fp16) puts an inf into one element of the last rank's local
    gradient shard at step 2, as a rank-local fp16 overflow would: every rank must skip that step;
    "per-shard-muon" orthogonalises each rank's shard of a Muon matrix instead of the whole matrix;
    "scaled-last-shard:EPS" multiplies the last rank's local gradient shards by (1 + EPS) before each
    optimizer step, as a reduction weighting one rank's part wrong by EPS would (a fault as small as
    wished: the regression guard of tools.agreement's bounds). Faults of the runtime itself (a
    skipped gradient sync, a wrong expert rank, unsummed tied gradients) are injected by the tests
    where the runtime acts (``tests/faults.py``)."""
    loss_scale: dict | None = None
    """fp16: ``LossScaler`` keyword arguments (default: its defaults); {"init_scale": 1.0,
    "growth_interval": 10**9} turns the scaling off in effect (a negative control)."""
    dtype: str = "float32"
    """The model's parameters and compute: "float64" makes a reference that tells which side of a
    difference between two fp32 runs is wrong (one process; MoE experts then run transformers'
    eager implementation: grouped_mm has no float64 kernel)."""
    adapter: dict | None = None  # LoRA: ``ndparallel.models.adapters.lora_config`` kwargs (r, alpha, ...)
    quantization: Any = None  # QLoRA: an ``NF4Config``: the base linears NF4 before parallelising
    load: Any = None
    """``load(engine, setup) -> model``, parallelised by ``engine`` (e.g. ``engine.build_model(dir, ...)``),
    instead of ``build_model`` + ``parallelize``: a module-level function (it travels to the ranks)."""
    model_dir: str | None = None
    """A saved model (``save_pretrained``) both runs load with ``Engine.build_model`` (sharded,
    transformers' key conversion) instead of building ``model_config`` from the seed."""


@dataclass
class TrainResult:
    losses: list[float]
    grad_norms: list[float]
    params: dict[str, torch.Tensor] | None  # full (unsharded) parameters after training, rank 0
    aux_losses: list[float] | None = None  # an MoE model's load-balancing loss per step (if it adds one)
    loss_scales: list[float] | None = None  # fp16: the loss scale after each step (this rank's)


def make_global_batches(setup: TrainSetup) -> list[list[dict[str, torch.Tensor]]]:
    """``steps`` × ``grad_accum`` micro-batches of [global_micro_batch, seq_len] random tokens
    (``setup.batches`` when given)."""
    if setup.batches is not None:
        return [[dict(mb) for mb in step] for step in setup.batches]
    if setup.rows is not None:
        loader = rows_loader(setup, 1, 0, 1)
        return [loader.step_micro_batches(step, setup.grad_accum) for step in range(setup.steps)]
    g = torch.Generator().manual_seed(setup.seed + 1)
    vocab = setup.model_config.vocab_size
    steps = []
    for _ in range(setup.steps):
        micro = []
        for _ in range(setup.grad_accum):
            tokens = torch.randint(0, vocab, (setup.global_micro_batch, setup.seq_len + 1), generator=g)
            labels = tokens[:, 1:].clone()
            labels[torch.rand(labels.shape, generator=g) < setup.ignore_fraction] = IGNORE_INDEX
            positions = torch.arange(setup.seq_len).expand(setup.global_micro_batch, -1).clone()
            if setup.packed_documents:
                positions = packed_positions(setup.global_micro_batch, setup.seq_len, g)
                last = torch.zeros_like(labels, dtype=torch.bool)
                last[:, :-1] = positions[:, 1:] == 0  # the label of a document's last token
                labels[last] = IGNORE_INDEX  # would be the next document's first token
            micro.append(
                {"input_ids": tokens[:, :-1].contiguous(), "shift_labels": labels, "position_ids": positions}
            )
        steps.append(micro)
    return steps


def rows_loader(setup: TrainSetup, seq_len_divisor: int, dp_rank: int, dp_size: int) -> PackedLoader:
    """The loader of ``setup.rows`` for one dp rank of a layout whose sequences must be multiples of
    ``seq_len_divisor``: micro-batches cut as ``pad_to_sequence_len: false`` cuts them."""
    multiple = width_multiple(seq_len_divisor)
    buckets = bucket_widths(setup.rows.shape[1], multiple) if setup.bucketed else None
    return PackedLoader(
        setup.rows,
        setup.global_micro_batch // dp_size,
        dp_rank=dp_rank,
        dp_size=dp_size,
        shuffle=False,
        pad_to_multiple=multiple,
        buckets=buckets,
    )


def packed_positions(rows: int, seq_len: int, generator: torch.Generator) -> torch.Tensor:
    """Position ids of rows packed with 1–4 documents of random lengths (restarting at 0)."""
    out = torch.empty(rows, seq_len, dtype=torch.int64)
    for r in range(rows):
        n_cuts = int(torch.randint(0, min(4, seq_len), (1,), generator=generator))
        cuts = sorted((torch.randperm(seq_len - 1, generator=generator)[:n_cuts] + 1).tolist())
        for a, b in zip([0, *cuts], [*cuts, seq_len]):
            out[r, a:b] = torch.arange(b - a)
    return out


def document_spans(position_ids: torch.Tensor) -> list[tuple[int, int]]:
    """[start, end) of each document of one row (a document starts where position_ids == 0)."""
    starts = [0] + [i for i in range(1, len(position_ids)) if int(position_ids[i]) == 0]
    return list(zip(starts, [*starts[1:], len(position_ids)]))


def build_model(setup: TrainSetup):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(setup.seed)
    extra = {"experts_implementation": "eager"} if setup.dtype == "float64" else {}
    model = AutoModelForCausalLM.from_config(setup.model_config, **extra).to(getattr(torch, setup.dtype))
    if setup.adapter is not None:  # PEFT's init continues the seeded stream: the same everywhere
        model = apply_adapter(model, lora_config(**setup.adapter))
    if setup.quantization is not None:  # the whole model on every rank: quantised whole (to_nf4)
        quantize_linears(model, setup.quantization)
    return model


def setup_optimizer(setup: TrainSetup, params):
    """The optimizer both runs use (the trainer's ``build_optimizer`` with the setup's settings)."""
    options = {**setup.optimizer_options, **({"per_shard": True} if setup.fault == "per-shard-muon" else {})}
    return build_optimizer(params, setup.optimizer, lr=setup.lr, weight_decay=setup.weight_decay, **options)


def strategy_options(setup: TrainSetup) -> StrategyOptions:
    return StrategyOptions.from_kwargs(mixed_precision=setup.mixed_precision, **setup.parallel_kwargs)


def train_under_layout(setup: TrainSetup, layout: dict[str, int] | None = None) -> TrainResult:
    """Run inside a rank (process group up): train with ``layout`` (ParallelismConfig kwargs; None =
    one process) through the engine's ``train_step`` — the step ``ndparallel train`` runs — and
    return losses, grad norms and the final full parameters (rank 0)."""

    engine = Engine(ParallelismConfig(**(layout or {})), strategy_options(setup))
    if setup.load is not None:
        model = setup.load(engine, setup)
    elif setup.model_dir:
        model = engine.build_model(setup.model_dir)
    else:
        model = engine.parallelize(build_model(setup))
    optimizer = setup_optimizer(setup, model)  # the model: low-bit AdamW finds its embeddings
    if (setup.fault or "").startswith("scaled-last-shard:"):
        _scale_last_rank_grads(optimizer, engine, float(setup.fault.split(":")[1]))
    model.train()
    dp_rank, dp_size = engine.dp_rank, engine.dp_size
    rows = setup.global_micro_batch // dp_size
    if rows * dp_size != setup.global_micro_batch:
        raise ValueError(f"global_micro_batch={setup.global_micro_batch} not divisible by dp={dp_size}")
    losses, norms, aux, scales = [], [], [], []
    scaler = loss_scaler(setup, engine)
    own_widths = setup.batches is None and setup.rows is not None  # each rank cuts its own rows
    loader = rows_loader(setup, engine.seq_len_divisor(), dp_rank, dp_size) if own_widths else None
    for i, micro_batches in enumerate(make_global_batches(setup)):
        if loader is not None:
            local = [
                batch_to_device(mb, engine.device) for mb in loader.step_micro_batches(i, setup.grad_accum)
            ]
        else:
            local = [
                {k: v[dp_rank * rows : (dp_rank + 1) * rows].to(engine.device) for k, v in mb.items()}
                for mb in micro_batches
            ]
        if setup.fault == "cross-documents":
            for mb in local:
                mb["position_ids"] = (
                    torch.arange(setup.seq_len, device=engine.device).expand(rows, -1).clone()
                )
        out = train_step(
            engine,
            model,
            optimizer,
            local,
            max_grad_norm=setup.max_grad_norm,
            step=i + 1,
            scaler=scaler,
            loss_reduction=setup.loss_reduction,
        )
        if scaler is not None:
            scales.append(scaler.scale)
        losses.append(float(out.loss))
        norms.append(float(out.grad_norm))
        if out.aux_loss is not None:
            aux.append(float(out.aux_loss))
    params = full_parameters(model)  # a collective: every rank gathers
    if engine.dims.pp_enabled:  # each stage gathered its own: rank 0 collects the others'
        params = gather_stage_states(engine, params)
    return TrainResult(
        losses,
        norms,
        params if engine.is_main_process else None,
        aux or None,
        scales if scaler is not None else None,
    )


def _scale_last_rank_grads(optimizer, engine, eps: float) -> None:
    """The "scaled-last-shard" fault: the last rank's gradient shards × (1 + eps) before each step."""
    if engine.rank != engine.world_size - 1:
        return

    def scale(opt, args, kwargs):
        for group in opt.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    grad = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
                    grad.mul_(1 + eps)

    optimizer.register_step_pre_hook(scale)


def loss_scaler(setup: TrainSetup, engine):
    """The fp16 run's ``LossScaler`` (None otherwise); with the "overflow-step-2" fault, one whose
    unscaling puts an inf into the last rank's first local gradient shard at step 2."""
    if setup.mixed_precision != "fp16":
        return None

    if setup.fault != "overflow-step-2":
        return LossScaler(**(setup.loss_scale or {}))
    last = engine.rank == engine.world_size - 1

    class InjectedOverflow(LossScaler):
        calls = 0

        def unscale_(self, parameters):
            parameters = list(parameters)
            InjectedOverflow.calls += 1
            grad = next(p.grad for p in parameters if p.grad is not None)
            local = grad.to_local() if hasattr(grad, "to_local") else grad
            if InjectedOverflow.calls == 2 and last and local.numel():
                local.view(-1)[0] = float("inf")
            super().unscale_(parameters)

    return InjectedOverflow(**(setup.loss_scale or {}))


def full_parameters(model) -> dict[str, torch.Tensor]:
    """Every parameter, unsharded, as fp32 CPU tensors (collective under FSDP/TP: all ranks call)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    state = get_model_state_dict(model)  # sharded; gathered one tensor at a time (NF4: see dequantize)
    return {
        k: (dequantize(v) if is_nf4(v) else v.full_tensor() if hasattr(v, "full_tensor") else v)
        .detach()
        .float()
        .cpu()
        .clone()
        for k, v in state.items()
    }


def train_documents_separately(setup: TrainSetup) -> TrainResult:
    """One process, no packing: every document of every row runs as its own sequence (positions
    from 0, nothing to mask), with the same global token count and optimizer. What packed rows
    must reproduce under every layout."""

    model = build_model(setup)
    optimizer = setup_optimizer(setup, model.parameters())
    model.train()
    losses, norms = [], []
    for micro_batches in make_global_batches(setup):
        n_items = int(sum((mb["shift_labels"] != IGNORE_INDEX).sum() for mb in micro_batches))
        step_loss = 0.0
        for mb in micro_batches:
            for row in range(mb["input_ids"].shape[0]):
                for a, b in document_spans(mb["position_ids"][row]):
                    logits = model(
                        input_ids=mb["input_ids"][row : row + 1, a:b],
                        position_ids=torch.arange(b - a).unsqueeze(0),
                        use_cache=False,
                    ).logits
                    loss = causal_lm_loss(logits, mb["shift_labels"][row : row + 1, a:b], n_items)
                    loss.backward()
                    step_loss += float(loss)
        max_norm = setup.max_grad_norm if setup.max_grad_norm is not None else float("inf")
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)))
        optimizer.step()
        optimizer.zero_grad()
        losses.append(step_loss)
    return TrainResult(losses, norms, full_parameters(model))


def compare(reference: TrainResult, other: TrainResult) -> dict[str, float | str]:
    """Largest relative loss / grad-norm difference, largest absolute parameter difference, and
    the largest relative parameter difference (``param_rel``: max |diff| / max |reference| of a
    tensor) with the tensor it is in (``param_rel_tensor``)."""

    def rel(a, b):
        if len(a) != len(b) or not a:
            raise AssertionError(
                f"the runs have {len(a)} and {len(b)} steps: nothing to compare step by step"
            )
        return max(_rel(x, y) for x, y in zip(a, b))

    out = {
        "loss_rel": rel(reference.losses, other.losses),
        "grad_norm_rel": rel(reference.grad_norms, other.grad_norms),
    }
    if (reference.aux_losses is None) != (other.aux_losses is None):
        raise AssertionError("one run has an auxiliary (router) loss and the other none")
    if reference.aux_losses is not None:
        out["aux_rel"] = rel(reference.aux_losses, other.aux_losses)
    if reference.params is not None and other.params is not None:
        missing = set(reference.params) ^ set(other.params)
        if missing:
            raise AssertionError(f"parameter names differ: {sorted(missing)[:5]}")
        out["param_abs"] = max(
            (reference.params[k] - other.params[k]).abs().max().item() for k in reference.params
        )
        out["param_rel"], out["param_rel_tensor"] = max(
            (_tensor_rel(reference.params[k], other.params[k]), k) for k in reference.params
        )
    return out


def largest_difference(diff: dict) -> tuple[float, str]:
    """The largest relative difference of a ``compare`` result and where it is: "loss", "grad norm",
    "aux loss" or a parameter's name."""
    where = {"loss_rel": "loss", "grad_norm_rel": "grad norm", "aux_rel": "aux loss"}
    candidates = [(diff[k], name) for k, name in where.items() if k in diff]
    if "param_rel" in diff:
        candidates.append((diff["param_rel"], diff["param_rel_tensor"]))
    return max(candidates)


def _tensor_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |a| (0 for equal tensors; inf where a is 0 and b is not)."""
    d = (a - b).abs().max().item() if a.numel() else 0.0
    scale = a.abs().max().item() if a.numel() else 0.0
    return 0.0 if d == 0 else d / scale if scale else math.inf


def _rel(x: float, y: float) -> float:
    """Relative difference; two non-finite values (an fp16 overflow step on both sides: inf or NaN
    norm) count as equal, one non-finite value against a finite one as infinitely different."""
    if not (math.isfinite(x) and math.isfinite(y)):
        return 0.0 if not (math.isfinite(x) or math.isfinite(y)) else math.inf
    return abs(x - y) / max(abs(x), 1e-12)


def with_overrides(setup: TrainSetup, **kwargs) -> TrainSetup:
    return dataclasses.replace(setup, **kwargs)
