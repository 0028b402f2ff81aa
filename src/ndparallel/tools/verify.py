"""``ndparallel verify``: the config's layout, on a shrunk model of the same architecture, must train
the same model as one process. A user's proof that their layout is right, on CPU, in seconds.
Rows are packed with several documents (position_ids restarting at 0), so the check also proves
that no attention crosses a document start under the layout."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from ndparallel.tools.shrink import shrink_config
from ndparallel.training.config import TrainConfig


def _adapter_kwargs(cfg: TrainConfig) -> dict | None:
    """The run's LoRA shape (a saved ``lora_model_dir`` adapter's r, alpha and targets; its tensors
    do not fit the shrunk model) at dropout 0: dropout's random mask differs per layout."""
    if cfg.adapter is None or not cfg.lora_model_dir:
        return cfg.lora_kwargs(dropout=0.0)
    saved = cfg.lora_config()
    targets = saved.target_modules
    return {"r": saved.r, "alpha": saved.lora_alpha, "dropout": 0.0, "target_linear": False,
            "target_modules": [targets] if isinstance(targets, str)  # leaf names: the model is shrunk
            else sorted({t.rsplit(".", 1)[-1] for t in targets or []})}


def _shrunk_nf4(cfg: TrainConfig):
    """QLoRA's NF4 base with blocks small enough for the shrunk model's weights (None without it)."""
    if not cfg.load_in_4bit:
        return None
    from ndparallel.models.quantized import NF4Config

    return NF4Config(16, 4, cfg.nf4_config().skip_modules)


def verify_layout(cfg: TrainConfig, pc, hf_config, steps: int = 3, tolerance: float = 1e-5,
                  fault: str | None = None) -> bool:
    """Run the layout and one process on CPU ranks; print the differences and a verdict."""
    import dataclasses

    from ndparallel.runtime.multirank import run_on_ranks
    from ndparallel.tools.equivalence import TrainSetup, compare, train_under_layout

    console = Console()
    small = shrink_config(hf_config, pc.tp_size, pc.cp_size)
    setup = TrainSetup(
        small, steps=steps, global_micro_batch=2 * pc.dp_size,
        grad_accum=min(cfg.gradient_accumulation_steps, 2), seq_len=16 * pc.cp_size,
        optimizer="adamw", lr=1e-2, max_grad_norm=cfg.max_grad_norm, packed_documents=True,
        adapter=_adapter_kwargs(cfg),
        quantization=_shrunk_nf4(cfg),
        parallel_kwargs=dict(fsdp_options=cfg.fsdp_options(), tp_options=cfg.tp_options(),
                             cp_options=cfg.cp_options(), loss_options=cfg.loss_options(),
                             # compile is checked at the dynamo / AOT-autograd level: inductor's
                             # C++ build would add minutes on CPU and changes no layout semantics
                             compile_options=dataclasses.replace(cfg.compile_options(), backend="aot_eager")),
    )
    console.print(
        f"verify: {pc.describe()} on {pc.total_size} CPU ranks vs 1 process; shrunk "
        f"{small.model_type}: hidden {small.hidden_size}, heads {small.num_attention_heads}/"
        f"{small.num_key_value_heads}, 2 layers, seq {setup.seq_len} (packed documents), {steps} "
        "AdamW steps" + (f", LoRA r={setup.adapter['r']} (dropout 0)" if setup.adapter else "")
        + (", 4-bit NF4 base (16 x 4 blocks: the shrunk weights are small)" if setup.quantization else "")
    )
    ref = run_on_ranks(train_under_layout, 1, dataclasses.replace(setup, parallel_kwargs={}), None)[0]
    got = run_on_ranks(train_under_layout, pc.total_size, dataclasses.replace(setup, fault=fault),
                       pc.to_dict(), timeout_s=600)[0]
    diff = compare(ref, got)
    table = Table(title="one process vs layout")
    for col in ("step", "loss (1 proc)", "loss (layout)", "rel. diff", "grad norm (1 proc)",
                "grad norm (layout)", "rel. diff"):
        table.add_column(col, justify="right")
    for i, (a, b, ga, gb) in enumerate(zip(ref.losses, got.losses, ref.grad_norms, got.grad_norms)):
        table.add_row(str(i + 1), f"{a:.6f}", f"{b:.6f}", f"{abs(a - b) / abs(a):.1e}",
                      f"{ga:.6f}", f"{gb:.6f}", f"{abs(ga - gb) / abs(ga):.1e}")
    console.print(table)
    ok = diff["loss_rel"] <= tolerance and diff["grad_norm_rel"] <= tolerance
    console.print(f"max parameter difference after {steps} steps: {diff.get('param_abs', float('nan')):.2e}")
    verdict = "[bold green]PASS[/]" if ok else "[bold red]FAIL[/]"
    console.print(f"{verdict}: max relative loss error {diff['loss_rel']:.1e}, grad norm "
                  f"{diff['grad_norm_rel']:.1e} (tolerance {tolerance:.0e})")
    return ok
