"""A training config as the planner's ``Settings``: the one typed conversion ``plan --config``
(``cli/plan_config.py``) and ``simulate``'s prediction (``tools/simulate_predict.py``) ask. The
runtime options decide what they name (``Settings.from_options``); this adds what the planner
names differently."""

from __future__ import annotations

from ndparallel.config.schema import TrainConfig
from ndparallel.optim.names import TORCHAO
from ndparallel.parallel.options import StrategyOptions
from ndparallel.plan.settings import Settings


def plan_settings(cfg: TrainConfig, options: StrategyOptions | None = None, **resolved) -> Settings:
    """The planner's settings of ``cfg``: its runtime options (``options``, else
    ``cfg.strategy_options()``) through ``Settings.from_options``, the optimizer by its state size,
    AdamW's fused kernel, the LoRA rank and the loss the trainer runs (QAT fake-quantises the LM
    head, so the loss then comes from the full logits). ``resolved``: values a running trainer
    knows better (``simulate``), by field name."""
    full_loss = cfg.chunked_loss is False or cfg.qat is not None
    named = {
        "optimizer": _plan_optimizer(cfg.optimizer),
        "optimizer_fused": cfg.optimizer == "adamw_torch_fused",
        "loss_impl": "full" if full_loss else "chunked",
        "lora_r": cfg.lora_r if cfg.adapter else 0,
    }
    options = cfg.strategy_options() if options is None else options
    return Settings.from_options(options, cfg.sequence_len, **{**named, **resolved})


def _plan_optimizer(name: str) -> str:
    """The planner's optimizer for a training config's (torchao's low-bit ones by their state size)."""
    if name in ("sgd", "muon"):
        return name
    return {"AdamW8bit": "adamw_8bit", "AdamWFp8": "adamw_8bit", "AdamW4bit": "adamw_4bit"}.get(
        TORCHAO.get(name, ""), "adamw"
    )
