"""What a user asks the planner (``PlanRequest``: the model, the cluster, the run's settings and
which of them the search chooses per layout) and what it answers (``LayoutResult``, ``PlanResult``)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields, replace

from ndparallel.layout.dims import ParallelDims
from ndparallel.plan.hardware import Hardware
from ndparallel.plan.models import ModelSpec
from ndparallel.plan.search.estimate import Estimate
from ndparallel.plan.settings import Settings

DEFAULT_SETTINGS = Settings(sequence_len=4096, chunked_loss=True)
"""A request's settings unless it gives its own: 4096 tokens, the chunked loss the trainer runs."""

SEARCHED = (
    "micro_batch_size",
    "activation_checkpointing",
    "ac_policy",
    "activation_offloading",
    "reshard_after_forward",
    "tiled_mlp",
    "unsharded_grad_accumulation",
    "pipeline_schedule",
    "pipeline_virtual_stages",
)
"""The settings the search chooses per layout (``search/choices.py`` lists each one's candidates):
``PlanRequest`` holds each under its ``Settings`` name, auto unless the user pinned it; the request's
``settings`` hold the rest."""


@dataclass(frozen=True)
class PlanRequest:
    """What the user asks: model, cluster, hardware, the run's ``settings`` and, under the same names
    (``SEARCHED``), what the search chooses per layout unless pinned."""

    model: ModelSpec
    hardware: Hardware
    gpus: int
    gpus_per_node: int = 8
    settings: Settings = DEFAULT_SETTINGS
    """Everything of the run but the layout and the searched settings (whose values in ``settings``
    are not read: ``base_settings``)."""
    global_batch_size: int | None = None
    """Sequences per optimizer step; None: about ``choices.DEFAULT_GLOBAL_BATCH_TOKENS`` (not
    enforced)."""
    micro_batch_size: int | None = None
    """None: try ``choices.AUTO_MICRO_BATCHES``."""
    activation_checkpointing: str = "auto"
    """'auto' (try both), 'on' or 'off'."""
    ac_policy: str | None = None
    """The checkpointing policy where checkpointing is on: 'full', 'selective' or 'op' (torchtitan's,
    for comparisons); None (auto): selective and full."""
    activation_offloading: bool | None = None
    """None (auto): tried where checkpointing alone does not fit; True / False: that."""
    reshard_after_forward: bool | None = None
    """None (auto): both where FSDP gathers parameters; True / False: that."""
    tiled_mlp: bool | None = None
    """None (auto): tried for a layout where nothing untiled fits; True / False: that."""
    unsharded_grad_accumulation: bool | None = None
    """FSDP gradients accumulated unsharded, reduced once per step. None (auto): pp layouts try both
    (one reduction per step by each stage's FSDP root, or one per micro-batch: the runtime's
    default), other layouts reduce on every micro-batch; True / False: that, everywhere."""
    host_mem_bytes: float | None = None
    """Host memory per node; with offloading, layouts whose offloaded bytes per node exceed
    ``HOST_BUDGET_FRACTION`` of it are rejected (``host_oom``). None: not checked."""
    host_mem_preset: bool = False
    """``host_mem_bytes`` is the GPU preset's typical node's (``Hardware.host_mem_per_node``), no
    ``--host-mem`` given."""
    pipeline_parallel: bool = True
    """Search pipeline-parallel layouts too (``--no-pipeline-parallel``: pp = 1 only)."""
    pipeline_schedule: str = "auto"
    """'auto': 1F1B and Interleaved1F1B (2 stages per rank) for each pp layout; else that schedule."""
    pipeline_virtual_stages: int | None = None
    """Stages per rank of the multi-stage schedules (None: the runtime's default, 2)."""

    @classmethod
    def of(cls, model: ModelSpec, hardware: Hardware, gpus: int, **options) -> PlanRequest:
        """A request with ``DEFAULT_SETTINGS`` and ``options`` (see ``updated``)."""
        return cls(model, hardware, gpus).updated(**options)

    def updated(self, **options) -> PlanRequest:
        """This request with ``options`` replaced, each by its name: a field of the request's own,
        else one of its ``settings``."""
        own = {f.name for f in fields(self)}
        mine = {k: v for k, v in options.items() if k in own}
        rest = {k: v for k, v in options.items() if k not in own}
        return replace(self, **{**mine, "settings": replace(mine.get("settings", self.settings), **rest)})


def base_settings(req: PlanRequest) -> Settings:
    """The request's settings before a layout's searched ones, the request's
    ``unsharded_grad_accumulation`` auto (None) as off."""
    return replace(req.settings, unsharded_grad_accumulation=bool(req.unsharded_grad_accumulation))


@dataclass
class LayoutResult:
    """One layout: its best option, all options, or why rejected."""

    layout: ParallelDims
    best: Estimate | None = None
    options: list[Estimate] = field(default_factory=list)
    rejections: list[tuple[str, str]] = field(default_factory=list)
    searched: int = 0
    """Options of the layout (the product of the searched settings' candidates)."""
    memory_checked: int = 0
    """Of those, the ones whose peak memory the search estimated (``search/bounds.py``)."""
    costed: int = 0
    """And the ones whose step it costed."""
    host_problems: list[str] = field(default_factory=list)
    """Why options that fit the device did not fit the node's host memory (``--host-mem``)."""

    @property
    def ok(self) -> bool:
        return self.best is not None

    def to_dict(self) -> dict:
        return {
            "layout": asdict(self.layout),
            "ok": self.ok,
            "best": self.best.to_dict() if self.best else None,
            "chosen": {k: getattr(self.best.settings, k) for k in SEARCHED} if self.best else None,
            "rejections": [{"code": c, "reason": r} for c, r in self.rejections],
        }


@dataclass
class PlanResult:
    request: PlanRequest
    ranked: list[LayoutResult]
    rejected: list[LayoutResult]
    fitting: int | None = None
    """How many layouts fit, where ``ranked`` holds only the best of them (``evaluation.plan``'s
    ``top``; ``find`` misses the others that fit); None: ``ranked`` holds every one."""

    @property
    def fit_count(self) -> int:
        return len(self.ranked) if self.fitting is None else self.fitting

    def find(self, layout: ParallelDims) -> LayoutResult | None:
        return next((r for r in self.ranked + self.rejected if r.layout == layout), None)
