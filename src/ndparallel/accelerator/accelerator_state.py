"""What Accelerate keeps in its ``AcceleratorState`` / ``GradientState`` singletons, kept here per
Accelerator instead (no global mutable state): the distributed type, the precision, and the
gradient-accumulation state the prepared optimizer, scheduler and loaders consult; and Accelerate's
enums (``DistributedType``, ``PrecisionType``, ``RNGType``, ``LoggerType``)."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class _AccelerateEnum(str, enum.Enum):  # noqa: UP042 - Accelerate's BaseEnum: str + Enum, not StrEnum
    """Accelerate's ``BaseEnum``: ``str()`` gives the value, ``list()`` every value."""

    def __str__(self) -> str:
        return self.value

    @classmethod
    def list(cls) -> list[str]:
        return [m.value for m in cls]


class DistributedType(_AccelerateEnum):
    """Accelerate's names for how a run is distributed (the ones that can occur here)."""

    NO = "NO"
    MULTI_CPU = "MULTI_CPU"
    MULTI_GPU = "MULTI_GPU"
    FSDP = "FSDP"
    DEEPSPEED = "DEEPSPEED"  # never set here: listed so comparisons in user scripts work
    MEGATRON_LM = "MEGATRON_LM"
    XLA = "XLA"


class PrecisionType(_AccelerateEnum):
    NO = "no"
    FP8 = "fp8"
    FP16 = "fp16"
    BF16 = "bf16"


class RNGType(_AccelerateEnum):
    TORCH = "torch"
    CUDA = "cuda"
    GENERATOR = "generator"


class LoggerType(_AccelerateEnum):
    ALL = "all"
    JSONL = "jsonl"
    AIM = "aim"
    TENSORBOARD = "tensorboard"
    WANDB = "wandb"
    COMETML = "comet_ml"
    MLFLOW = "mlflow"
    CLEARML = "clearml"
    DVCLIVE = "dvclive"
    SWANLAB = "swanlab"
    TRACKIO = "trackio"


@dataclass
class GradientState:
    """Gradient-accumulation state (Accelerate's ``GradientState``) of one Accelerator.

    ``sync_gradients`` is True on the micro-batch that completes an optimizer step; prepared
    optimizers skip ``step``/``zero_grad`` and prepared schedulers skip ``step`` otherwise.
    """

    num_steps: int = 1
    adjust_scheduler: bool = True
    sync_with_dataloader: bool = True
    sync_each_batch: bool = False
    sync_gradients: bool = True
    end_of_dataloader: bool = False
    remainder: int = -1  # samples of the last global batch that are real (not padding); -1 unknown
    in_dataloader: bool = False

    @property
    def plugin_kwargs(self) -> dict:
        """The accumulation plugin's settings, under Accelerate's name (transformers' ``Trainer``
        reads ``sync_each_batch`` here)."""
        return {
            "num_steps": self.num_steps,
            "adjust_scheduler": self.adjust_scheduler,
            "sync_with_dataloader": self.sync_with_dataloader,
            "sync_each_batch": self.sync_each_batch,
        }

    def _set_sync_gradients(self, sync_gradients: bool) -> None:
        """Accelerate's setter: a loop that decides itself which micro-batch completes a step
        (transformers' ``Trainer``) says so here."""
        self.sync_gradients = bool(sync_gradients)


@dataclass(frozen=True)
class AcceleratorState:
    """A read-only view of where this process sits, under Accelerate's attribute names."""

    distributed_type: DistributedType
    num_processes: int
    process_index: int
    local_process_index: int
    device: object
    mixed_precision: str
    parallelism_config: object
    device_mesh: object
    fsdp_plugin: object = None
    deepspeed_plugin: None = None
    dynamo_plugin: object = None

    @property
    def use_distributed(self) -> bool:
        return self.num_processes > 1

    @property
    def is_main_process(self) -> bool:
        return self.process_index == 0

    @property
    def is_local_main_process(self) -> bool:
        return self.local_process_index == 0

    @property
    def is_last_process(self) -> bool:
        return self.process_index == self.num_processes - 1

    @property
    def is_fsdp2(self) -> bool:
        return self.distributed_type == DistributedType.FSDP
