"""Pipeline-parallel checks of a training config, before any rank starts: the schedule, the stage
split against the model's layers, the micro-batches against the stages, and what does not compose
with pipeline parallel yet (each refused by name; a LoRA adapter's own case is checked with the
adapter, ``model_check.check_adapter``)."""

from __future__ import annotations

from ndparallel.config import ConfigError, TrainConfig
from ndparallel.parallel.pp.split import bubble_fraction, pipeline_problem, plan_stages
from ndparallel.parallel.pp.stages import (
    RING_CP_UNDER_PP_ON_CPU,
    ROUTER_LOSS_UNDER_PP,
    pipeline_family_problem,
)


def pipeline_config_problem(cfg: TrainConfig, pc, hf) -> str | None:
    """Why this config's pipeline cannot run, or None (also None without pipeline parallel,
    unless the schedule name itself is wrong)."""

    options = cfg.pipeline_options()
    pp = pc.pp_size
    if pp <= 1:
        return pipeline_problem(options, pp, None, None)
    text = hf.get_text_config() if hasattr(hf, "get_text_config") else hf
    family = pipeline_family_problem(text)
    if family:
        return family
    rows = cfg.micro_batch_size * cfg.gradient_accumulation_steps
    microbatches = cfg.pipeline_microbatches or cfg.gradient_accumulation_steps
    if rows % microbatches:
        return (
            f"pipeline_microbatches={microbatches} must divide the rows of a step on one data-parallel rank, "
            f"micro_batch_size × gradient_accumulation_steps = {rows}"
        )
    problem = pipeline_problem(options, pp, getattr(text, "num_hidden_layers", None), microbatches)
    if problem:
        return problem
    if (
        getattr(text, "output_router_logits", False)
        and getattr(text, "router_aux_loss_coef", None) is not None
    ):
        return ROUTER_LOSS_UNDER_PP
    refusals = [
        (cfg.fp8, "fp8: true"),
    ]
    for refused, what in refusals:
        if refused:
            return (
                f"pipeline_parallel_size={pp} with {what} is not supported yet: set pipeline_parallel_size: "
                f"1, "
                "or drop that setting (docs/pipeline_parallel.md, 'What composes')"
            )
    if pc.cp_enabled and cfg.cp_options().comm_strategy == "ring" and cfg.device == "cpu":
        return RING_CP_UNDER_PP_ON_CPU
    return None


def check_pipeline(cfg: TrainConfig, pc, hf) -> None:
    problem = pipeline_config_problem(cfg, pc, hf)
    if problem:
        raise ConfigError(problem)


def pipeline_summary(cfg: TrainConfig, pc, hf) -> str:
    """One line for ``--dry-run``: schedule, stages and their layers, micro-batches, the bubble."""

    text = hf.get_text_config() if hasattr(hf, "get_text_config") else hf
    plan = plan_stages(cfg.pipeline_options(), pc.pp_size, text.num_hidden_layers)
    m = cfg.pipeline_microbatches or cfg.gradient_accumulation_steps
    layers = " | ".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else f"{r[0]}" for r in plan.layers)
    return (
        f"{plan.schedule}, {plan.n_stages} stages ({plan.virtual} per rank; layers {layers}), "
        f"{m} micro-batches per step; idle share (bubble) ≈ {bubble_fraction(plan, m):.0%}"
    )
