"""A training config as the planner's ``Settings``: the one typed conversion ``plan --config``
(``cli/plan_config.py``) and ``simulate``'s prediction (``tools/simulate_predict.py``) ask. The
runtime options decide what they name (``Settings.from_options``); this adds the optimizer, the
LoRA rank and the loss the trainer runs."""

from __future__ import annotations

from ndparallel.config.schema import TrainConfig
from ndparallel.parallel.options import StrategyOptions
from ndparallel.plan.adapters.lora_cost import saved_tables
from ndparallel.plan.settings import Settings, plan_optimizer


def plan_settings(cfg: TrainConfig, options: StrategyOptions | None = None, **resolved) -> Settings:
    """The planner's settings of ``cfg``: its runtime options (``options``, else
    ``cfg.strategy_options()``) through ``Settings.from_options``, its batch, the optimizer by its
    state size and kernel (``plan_optimizer``), the adapter (rank, 4-bit base, tables trained in
    full) and the loss the trainer runs (QAT fake-quantises the LM head, so the loss then comes from
    the full logits). ``resolved``: values a running
    trainer knows better (``simulate``), by field name."""
    optimizer, fused = plan_optimizer(cfg.optimizer)
    named = {
        "micro_batch_size": cfg.micro_batch_size,
        "gradient_accumulation_steps": cfg.gradient_accumulation_steps,
        "optimizer": optimizer,
        "optimizer_fused": fused,
        "chunked_loss": cfg.chunked_loss is not False and cfg.qat is None,
        "lora_r": cfg.lora_r if cfg.adapter else 0,
        "load_in_4bit": bool(cfg.adapter and cfg.load_in_4bit),
        "lora_saved": saved_tables(cfg.lora_modules_to_save) if cfg.adapter else (),
    }
    options = cfg.strategy_options() if options is None else options
    return Settings.from_options(options, cfg.sequence_len, **{**named, **resolved})
