"""``ndparallel verify``: the config's layout, on a shrunk model of the same architecture, must train
the same model as one process. A user's proof that their layout is right, on CPU, in seconds.
Rows are packed with several documents (position_ids restarting at 0), so the check also proves
that no attention crosses a document start under the layout."""

from __future__ import annotations

import math

from rich.console import Console
from rich.table import Table

from ndparallel.config import TrainConfig
from ndparallel.models.quantized import NF4Config
from ndparallel.parallel.pp.split import virtual_stages
from ndparallel.runtime.multirank import run_on_ranks
from ndparallel.tools.agreement import (
    Reference,
    quantiser_bounds,
    reference_in_rank,
    split_micro_batches,
    stated_bounds,
    verdict,
)
from ndparallel.tools.equivalence import TrainSetup, train_under_layout
from ndparallel.tools.shrink import shrink_config


def _adapter_kwargs(cfg: TrainConfig) -> dict | None:
    """The run's LoRA shape (a saved ``lora_model_dir`` adapter's r, alpha and targets; its tensors
    do not fit the shrunk model) at dropout 0: dropout's random mask differs per layout."""
    if cfg.adapter is None or not cfg.lora_model_dir:
        return cfg.lora_kwargs(dropout=0.0)
    saved = cfg.lora_config()
    targets = saved.target_modules
    return {
        "r": saved.r,
        "alpha": saved.lora_alpha,
        "dropout": 0.0,
        "target_linear": False,
        "target_modules": [targets]
        if isinstance(targets, str)  # leaf names: the model is shrunk
        else sorted({t.rsplit(".", 1)[-1] for t in targets or []}),
    }


def _shrunk_nf4(cfg: TrainConfig):
    """QLoRA's NF4 base with blocks small enough for the shrunk model's weights (None without it)."""
    if not cfg.load_in_4bit:
        return None

    return NF4Config(16, 4, cfg.nf4_config().skip_modules)


EXACT_STEPS_NOTE = (
    "SGD steps: the exact check (AdamW divides by sqrt(v) and so turns fp32 rounding on "
    "near-zero gradients into lr-sized steps; gradients and SGD updates show the layout itself)"
)


def _shrunk_qat(cfg: TrainConfig, small):
    """The run's QAT settings for the shrunk model (int4 groups that divide its linears), or None:
    no QAT, nvfp4 (no fp4 matmul on the CPU ranks), or an mxfp4 block the shrunk widths do not hold."""
    import dataclasses
    import math

    import torch
    from transformers import AutoModelForCausalLM

    o = cfg.qat_options()
    if not o.enabled or o.weight_dtype == "nvfp4":
        return None
    with torch.device("meta"):
        widths = [
            m.in_features
            for m in AutoModelForCausalLM.from_config(small).modules()
            if isinstance(m, torch.nn.Linear)
        ]
    if o.weight_dtype == "int4":
        return dataclasses.replace(o, group_size=math.gcd(o.group_size, *widths))
    return None if o.weight_dtype == "mxfp4" and any(w % 32 for w in widths) else o


BF16_TOLERANCE = 2e-2
"""Relative loss / grad-norm tolerance of the run at the config's precision (bf16/fp16 compute, fp8):
both sides round differently (sharded matmuls, reduction orders), so only gross errors show."""
QUANTISED = object()
"""The QAT run's bounds: twice its own effect against the fp32 one-process run (``quantiser_bounds``)."""


def _norm_diff(a: float, b: float) -> str:
    """The grad-norm column: an fp16 overflow (non-finite on both sides) is a skipped step."""
    if not (math.isfinite(a) or math.isfinite(b)):
        return "skipped"
    return f"{abs(a - b) / abs(a):.1e}"


def _setup(cfg: TrainConfig, pc, small, steps: int):
    """What both sides of the check train: the run's own strategy options (as ``train`` builds
    them), fp32, SGD, on packed rows of random documents."""
    import dataclasses

    options = cfg.strategy_options()
    return TrainSetup(
        small,
        steps=steps,
        global_micro_batch=2 * pc.dp_size,
        grad_accum=min(cfg.gradient_accumulation_steps, 2),
        seq_len=16 * pc.cp_size,
        optimizer="sgd",
        lr=1e-2,
        max_grad_norm=cfg.max_grad_norm,
        loss_reduction=cfg.loss_reduction,
        packed_documents=True,
        adapter=_adapter_kwargs(cfg),
        quantization=_shrunk_nf4(cfg),
        parallel_kwargs=dict(
            fsdp_options=options.fsdp,
            activation_options=options.activation,
            tp_options=options.tp,
            cp_options=options.cp,
            loss_options=options.loss,
            # compile is checked at the dynamo / AOT-autograd level: inductor's C++ build would add
            # minutes on CPU and changes no layout semantics
            compile_options=dataclasses.replace(options.compile, backend="aot_eager"),
            # float8 matmuls emulated in high precision (the CPU ranks have no fp8 units)
            float8_options=dataclasses.replace(options.float8, emulate=True),
        ),
    )


def _table(console, title: str, ref, got) -> None:
    table = Table(title=title)
    for col in (
        "step",
        "loss (1 proc)",
        "loss (layout)",
        "rel. diff",
        "grad norm (1 proc)",
        "grad norm (layout)",
        "rel. diff",
    ):
        table.add_column(col, justify="right")
    for i, (a, b, ga, gb) in enumerate(zip(ref.losses, got.losses, ref.grad_norms, got.grad_norms)):
        table.add_row(
            str(i + 1),
            f"{a:.6f}",
            f"{b:.6f}",
            f"{abs(a - b) / abs(a):.1e}",
            f"{ga:.6f}",
            f"{gb:.6f}",
            _norm_diff(ga, gb),
        )
    console.print(table)


def _enough_layers_for_stages(small, cfg: TrainConfig, pc):
    """The shrunk model with a decoder layer for every pipeline stage (its two layer kinds
    repeated): two layers cannot fill 2 stages × 2 virtual stages."""
    if pc.pp_size <= 1:
        return small

    stages = pc.pp_size * virtual_stages(cfg.pipeline_options())
    if stages <= small.num_hidden_layers:
        return small
    kinds = getattr(small, "layer_types", None)
    small.num_hidden_layers = stages
    if isinstance(kinds, list) and kinds:
        small.layer_types = [kinds[i % len(kinds)] for i in range(stages)]
    return small


def verify_layout(cfg: TrainConfig, pc, hf_config, steps: int = 3) -> bool:
    """Train a shrunk copy of the model under the config's layout and options and on one process,
    through the trainer's own ``train_step``; print the differences and a verdict. The verdict
    rests on exact quantities: fp32 losses, gradient norms and the parameters after ``steps``
    SGD steps, held to the bounds of ``tools.agreement`` (the one rule the tests use: the
    reference's measured noise floor × a safety factor). With ``bf16`` or ``fp8`` the same is run
    again at that precision against one process at that precision (a looser, stated tolerance);
    with ``qat`` again with fake quantisation on both sides, held to twice QAT's own effect
    (``agreement.quantiser_bounds``: quantisation levels flip on fp32 noise)."""
    import dataclasses

    console = Console()
    small = _enough_layers_for_stages(shrink_config(hf_config, pc.tp_size, pc.cp_size, pc.ep_size), cfg, pc)
    setup = _setup(cfg, pc, small, steps)
    kv = getattr(small, "num_key_value_heads", None) or small.num_attention_heads  # GPT-NeoX: no GQA field
    console.print(
        f"verify: {pc.describe()} on {pc.total_size} CPU ranks vs 1 process; shrunk "
        f"{small.model_type}: hidden {small.hidden_size}, heads {small.num_attention_heads}/{kv}, "
        f"{small.num_hidden_layers} layers, seq {setup.seq_len} (packed documents), {steps} "
        + EXACT_STEPS_NOTE
        + (f"; LoRA r={setup.adapter['r']} (dropout 0)" if setup.adapter else "")
        + ("; a 4-bit NF4 base (16 x 4 blocks: the shrunk weights are small)" if setup.quantization else "")
    )
    low_bounds = stated_bounds(BF16_TOLERANCE, f"stated {BF16_TOLERANCE:.0e}: low-precision rounding")
    runs = [("fp32", setup, None)]
    if cfg.compute_dtype() is not None or cfg.fp8:  # bf16, or fp16 with its loss scaling
        low = cfg.compute_dtype_name()
        runs.append(
            (
                low + (" + fp8" if cfg.fp8 else ""),
                dataclasses.replace(setup, mixed_precision=low if low != "fp32" else "no"),
                low_bounds,
            )
        )
    qat = _shrunk_qat(cfg, small)
    if qat is not None:  # fake quantisation rounds: a value on a level boundary may go either way
        runs.append(
            (
                f"fp32 + qat {qat.weight_dtype}",
                dataclasses.replace(setup, parallel_kwargs={**setup.parallel_kwargs, "qat_options": qat}),
                QUANTISED,
            )
        )
    elif cfg.qat is not None:
        console.print(
            f"qat {cfg.qat.weight_dtype}: not run here (fp4 matmuls need a Blackwell GPU, or the shrunk "
            "model's widths do not hold its blocks); the fp32 check covers the layout"
        )
    ok, plain = True, None
    for name, run, bounds in runs:
        kept = {k: v for k, v in run.parallel_kwargs.items() if k == "qat_options"}  # one process, with QAT
        one = dataclasses.replace(run, parallel_kwargs=kept)
        if run.loss_reduction == "micro_batch_mean" and pc.dp_size > 1:  # each dp rank's micro-batches
            one = split_micro_batches(one, pc.dp_size)
        if bounds is None:  # fp32: the reference with its measured noise floor
            ref = run_on_ranks(reference_in_rank, 1, one, timeout_s=600)[0]
            plain = ref.result
        elif bounds is QUANTISED:  # against the fp32 one-process run above: QAT's own effect
            quantised = run_on_ranks(train_under_layout, 1, one, None, timeout_s=600)[0]
            ref = Reference(quantised, quantiser_bounds(quantised, plain))
        else:
            ref = Reference(run_on_ranks(train_under_layout, 1, one, None, timeout_s=600)[0], bounds)
        got = run_on_ranks(train_under_layout, pc.total_size, run, pc.to_dict(), timeout_s=600)[0]
        _table(console, f"{name}: one process vs layout", ref.result, got)
        result = verdict(ref, got, params=name == "fp32")
        ok = ok and result.ok
        console.print(
            f"{'[bold green]ok[/]' if result.ok else '[bold red]differs[/]'} ({name}): {result.line()}"
        )
    console.print("[bold green]PASS[/]" if ok else "[bold red]FAIL[/]")
    return ok
