"""The typed training runtime under both front doors (``ndparallel train`` and the Accelerate
facade): ``Engine`` (process group, layout, mesh, strategies, loss, CP batches), ``build_model``
(meta → parallelise → materialise → load this rank's shards) and the one ``train_step`` (with ``LossScaler``
for fp16)."""

from ndparallel.engine.engine import Engine
from ndparallel.engine.loss_scale import LossScaler
from ndparallel.engine.step import StepResult, batch_to_device, forward_backward, train_step

__all__ = ["Engine", "LossScaler", "StepResult", "batch_to_device", "forward_backward", "train_step"]
