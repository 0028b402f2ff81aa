"""How a training run stops before its last step: preemption (SIGTERM / SIGUSR1) and Ctrl-C.

Preemption (``runtime/preemption.py``): after the step on which the ranks agreed, the trainer
waits for a checkpoint still being written in the background, saves this step (unless the last
save was this step, or ``preemption_checkpoint: false``) and every rank raises ``Preempted``: exit
75 with one line from rank 0. Ctrl-C: ``Interrupted`` — exit 130, one line, no checkpoint
written for it; complete ones are untouched (a save cut short has no marker).
"""

from __future__ import annotations

import time
from pathlib import Path

from ndparallel.checkpoint.directory import list_checkpoints, validate_checkpoint
from ndparallel.runtime.preemption import PREEMPTED_EXIT, Preempted


class Interrupted(Exception):
    """Ctrl-C / SIGINT during training (``step``: optimizer steps completed)."""

    def __init__(self, step: int | None):
        super().__init__(f"interrupted at step {step}" if step is not None else "interrupted")
        self.step = step


def newest_complete(output_dir) -> Path | None:
    """The newest complete ``checkpoint-N`` (marker and file sizes checked, no hashing)."""

    for _, path in reversed(list_checkpoints(output_dir)):
        if not validate_checkpoint(path, deep=False):
            return path
    return None


def interrupted_line(step: int | None, output_dir) -> str:
    ckpt = newest_complete(output_dir)
    where = f"at step {step}" if step is not None else "during start-up"
    keep = (
        f"the newest complete checkpoint is {ckpt} (resume_from_checkpoint: auto continues from it)"
        if ckpt is not None
        else "no checkpoint was written"
    )
    return f"ndparallel train: interrupted {where} (Ctrl-C): {keep}"


def stop_for_preemption(trainer) -> Preempted:
    """Save (per ``preemption_checkpoint``) after the agreed step; the exception every rank raises."""
    cfg, step, watch = trainer.cfg, trainer.state.step, trainer.preemption
    watch.step = step
    started = time.perf_counter()
    if cfg.preemption_checkpoint:
        trainer.nonfinite.check()  # never a checkpoint of a diverged model
        path = trainer.save_checkpoint()
        how = f"checkpoint saved to {path} ({time.perf_counter() - started:.1f} s)"
    else:
        path, ckpt = None, newest_complete(cfg.output_dir)
        how = "preemption_checkpoint is false: no checkpoint written" + (
            f" (the newest complete is {ckpt})" if ckpt is not None else ""
        )
    watch.finished()
    again = (
        "run the same command again to resume"
        if cfg.resume_from_checkpoint
        else "set resume_from_checkpoint: auto and run the command again to resume"
    )
    return Preempted(
        f"ndparallel train: preempted ({watch.signal_name}) after step {step}: {how}; "
        f"exit {PREEMPTED_EXIT}: {again}",
        step,
        path,
    )
