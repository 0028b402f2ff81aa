"""The planner: which (pp, dp_replicate, dp_shard, cp, tp, ep) layout fits and is fastest.

See docs/planner.md for the memory, compute and communication models.
"""

from ndparallel.plan.cli_arguments import parse_layout
from ndparallel.plan.comms import Collective, aggregate, predict_collectives
from ndparallel.plan.hardware import Hardware
from ndparallel.plan.layout import Layout, Settings
from ndparallel.plan.memory import MemoryBreakdown, estimate_memory
from ndparallel.plan.models import ModelSpec, load_model_spec
from ndparallel.plan.search import (
    PlanRequest,
    PlanResult,
    estimate,
    evaluate_layout,
    plan,
)

__all__ = [
    "Collective",
    "Hardware",
    "Layout",
    "MemoryBreakdown",
    "ModelSpec",
    "PlanRequest",
    "PlanResult",
    "Settings",
    "aggregate",
    "estimate",
    "estimate_memory",
    "evaluate_layout",
    "load_model_spec",
    "parse_layout",
    "plan",
    "predict_collectives",
]
