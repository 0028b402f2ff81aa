"""Checkpoints: sharded training state (DCP, any layout to any layout), the directories that hold
them, safe I/O, and the consolidated Hugging Face export (which depends on the rest, never the
reverse)."""

from ndparallel.checkpoint.async_save import AsyncCheckpointer
from ndparallel.checkpoint.directory import (
    HF_CONFIG_DIR,
    MARKER,
    checkpoint_dir,
    find_resume_checkpoint,
    list_checkpoints,
    rotate_checkpoints,
    validate_checkpoint,
)
from ndparallel.checkpoint.state import (
    load_checkpoint,
    load_state,
    save_checkpoint,
    save_state,
    save_step_checkpoint,
)

__all__ = [
    "AsyncCheckpointer",
    "HF_CONFIG_DIR",
    "MARKER",
    "checkpoint_dir",
    "find_resume_checkpoint",
    "list_checkpoints",
    "load_checkpoint",
    "load_state",
    "rotate_checkpoints",
    "save_checkpoint",
    "save_state",
    "save_step_checkpoint",
    "validate_checkpoint",
]
