"""The training config's pipeline-parallel fields (ndparallel's own: Axolotl has none). A mixin of
``TrainConfig``; the checks against the model and the rest of the config are
``preflight/pipeline_check.py``, the runtime ``parallel/pp/schedule.py`` (docs/pipeline_parallel.md)."""

from __future__ import annotations

from pydantic import AliasChoices, Field

from ndparallel.config.base import _Strict
from ndparallel.parallel.options import PipelineOptions


class PipelineFields(_Strict):
    pipeline_parallel_size: int = Field(
        1, ge=1, validation_alias=AliasChoices("pipeline_parallel_size", "pp_size")
    )
    """Pipeline stages: the decoder layers split over this many groups of ranks, each laid out by
    the four other sizes (multiplies the world)."""
    pipeline_schedule: str = "1F1B"
    """GPipe, 1F1B, Interleaved1F1B, InterleavedZeroBubble, ZBVZeroBubble (torch's schedules)."""
    pipeline_microbatches: int | None = Field(None, ge=1)
    """Pipeline micro-batches per step (dividing micro_batch_size × gradient_accumulation_steps
    rows); default: one per gradient-accumulation micro-batch."""
    pipeline_virtual_stages: int | None = Field(None, ge=1)
    """Stages per rank; default 1, 2 for the interleaved and zero-bubble schedules."""
    pipeline_layers_per_stage: int | None = Field(None, ge=1)
    """Decoder layers per stage (default: an even split)."""
    pipeline_split_points: list[int] | None = None
    """The first decoder layer of each stage after the first (exclusive with layers_per_stage)."""

    def pipeline_options(self) -> PipelineOptions:
        return PipelineOptions(
            schedule=self.pipeline_schedule,
            microbatches=self.pipeline_microbatches,
            virtual_stages=self.pipeline_virtual_stages,
            layers_per_stage=self.pipeline_layers_per_stage,
            split_points=tuple(self.pipeline_split_points)
            if self.pipeline_split_points is not None
            else None,
        )
