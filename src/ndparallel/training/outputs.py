"""The ``output_dir`` rules: a run never deletes or overwrites what it did not write.

* A new run (no resume) starts only in a missing or empty ``output_dir``. One that holds another
  run or other files is refused, unless ``overwrite_output_dir: true``: then the previous run's
  files (those its run record claims, ``checkpoint/ownership.py``) are deleted and the rest is
  left alone.
* Resuming (``resume_from_checkpoint``, or an elastic restart) continues the run recorded there.
  In a directory of an older ndparallel without a run record, its ``checkpoint-N``,
  ``metrics.jsonl`` and ``config.resolved.yaml`` are adopted.
* Whatever the case, an entry this run would write (``metrics.jsonl``, ``metrics.png``,
  ``config.resolved.yaml``, ``final/``, ``merged/``, ``comm_profile/``, ``checkpoint-N/``) that no run
  recorded
  writing is never replaced: the run is refused, naming it.

``plan_output_dir`` decides (pure, read-only): the launcher calls it before any rank starts
(``preflight``), and rank 0 calls it again in the trainer right before the first write, then
applies the decision and tells every rank (``claim_output_dir``).
"""

from __future__ import annotations

import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from ndparallel.checkpoint.ownership import RUN_FILE, claim, read_run, start_run
from ndparallel.config import TrainConfig

_CHECKPOINT = re.compile(r"^checkpoint-\d+$")
_ADOPTED_WITHOUT_RECORD = ("metrics.jsonl", "config.resolved.yaml")


@dataclass
class OutputPlan:
    """What a run may do in its ``output_dir``."""

    conflicts: list[str] = field(default_factory=list)  # one-line reasons to refuse; empty = go
    new_run: bool = True  # start a new run record (else keep the resumed run's)
    delete: list[str] = field(default_factory=list)  # a previous run's entries (overwrite_output_dir)
    adopt: list[str] = field(default_factory=list)  # an older ndparallel's entries, when resuming
    writes: list[str] = field(default_factory=list)  # the entries this run claims at start


def run_writes(cfg: TrainConfig, profile_comm: bool = False) -> list[str]:
    """The fixed top-level entries a training run writes (checkpoint-N are claimed when saved)."""
    names = ["config.resolved.yaml", "metrics.jsonl", "metrics.png"]
    if cfg.save_final_model:
        names.append("final")
        if cfg.adapter is not None and cfg.merge_lora:
            names.append("merged")
    if profile_comm:
        names.append("comm_profile")
    for tracker, entry in (("wandb", "wandb"), ("tensorboard", "runs")):
        if tracker in cfg.trackers():
            names.append(entry)
    return names


def plan_output_dir(cfg: TrainConfig, resuming: bool, profile_comm: bool = False) -> OutputPlan:
    """Decide, without writing anything, whether and how this run may use ``cfg.output_dir``."""
    out = Path(cfg.output_dir).expanduser()
    plan = OutputPlan(writes=run_writes(cfg, profile_comm))
    blocker = next((p for p in [out, *out.parents] if p.exists() and not p.is_dir()), None)
    if blocker is not None:
        plan.conflicts.append(
            f"output_dir={cfg.output_dir!r}: {blocker} is a file, not a directory; give a directory path"
        )
        return plan
    if not out.is_dir():
        return plan
    run = read_run(out)
    entries = sorted(
        p.name
        for p in out.iterdir()
        if p.name != RUN_FILE and not p.name.startswith(f".{RUN_FILE}") and p.name != _cache_entry(cfg, out)
    )
    owned = set(run["written"]) if run else set()
    if resuming:
        plan.new_run = run is None
        if run is None:  # an older ndparallel's run: adopt what can only be its own
            plan.adopt = [n for n in entries if _CHECKPOINT.match(n) or n in _ADOPTED_WITHOUT_RECORD]
            owned = set(plan.adopt)
    elif run is not None or entries:
        if not cfg.overwrite_output_dir:
            plan.conflicts.append(_occupied(cfg.output_dir, run, entries))
            return plan
        plan.delete = [n for n in entries if n in owned]
    foreign = [n for n in entries if n not in owned]
    collide = [n for n in foreign if n in plan.writes or _CHECKPOINT.match(n)]
    if collide:
        plan.conflicts.append(
            f"output_dir={cfg.output_dir!r} holds {', '.join(collide[:4])}, which no ndparallel run there "
            "wrote: this run would overwrite it. Move it away or pick another output_dir (files a run did "
            "not write are never deleted or overwritten, even with overwrite_output_dir)"
        )
    return plan


def _cache_entry(cfg: TrainConfig, out: Path) -> str | None:
    """The top-level entry of ``output_dir`` that holds ``dataset_cache_dir``, if it is inside:
    a shared cache, neither the run's nor foreign."""
    if not cfg.dataset_cache_dir:
        return None
    try:
        inside = Path(cfg.dataset_cache_dir).expanduser().resolve().relative_to(out.resolve())
    except ValueError:
        return None
    return inside.parts[0] if inside.parts else None


def _occupied(output_dir: str, run: dict | None, entries: list[str]) -> str:
    shown = ", ".join(entries[:4]) + (f" and {len(entries) - 4} more" if len(entries) > 4 else "")
    if run is not None:
        return (
            f"output_dir={output_dir!r} holds another run ({shown or 'its run record'}): resume it with "
            "resume_from_checkpoint: auto, pick a new output_dir, or set overwrite_output_dir: true to "
            "replace that run's files"
        )
    return (
        f"output_dir={output_dir!r} is not empty ({shown}): pick a new or empty output_dir, resume "
        "with resume_from_checkpoint: auto, or set overwrite_output_dir: true (files no ndparallel "
        "run wrote are left alone)"
    )


def apply_output_plan(cfg: TrainConfig, plan: OutputPlan) -> None:
    """Rank 0: delete the previous run's entries (overwrite), start or keep the run record, claim
    this run's fixed entries. Nothing but claimed entries is ever deleted."""
    out = Path(cfg.output_dir).expanduser()
    for name in plan.delete:
        path = out / name
        if path.is_dir() and not path.is_symlink():
            (path / "COMPLETE").unlink(missing_ok=True)  # a half-deleted checkpoint is never "complete"
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)
    if plan.new_run:
        start_run(out)
    claim(out, *plan.adopt, *plan.writes)


def claim_output_dir(engine, cfg: TrainConfig, resuming: bool, profile_comm: bool = False) -> None:
    """On every rank, before the first write to ``output_dir``: rank 0 decides (again: files may
    have appeared since the launcher checked) and applies the plan; every rank raises the same
    ``ValueError`` when it is refused."""
    message = ""
    if engine.is_main_process:
        plan = plan_output_dir(cfg, resuming, profile_comm)
        message = "; ".join(plan.conflicts)
        if not message:
            apply_output_plan(cfg, plan)
    message = _broadcast_text(message, engine.device)
    if message:
        raise ValueError(message)


def _broadcast_text(text: str, device) -> str:
    """Rank 0's ``text`` on every rank, as bytes in a tensor (nothing is unpickled)."""
    import torch
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return text
    data = torch.tensor(list(text.encode()), dtype=torch.uint8, device=device)
    size = torch.tensor([data.numel()], dtype=torch.int64, device=device)
    dist.broadcast(size, src=0)
    if dist.get_rank() != 0:
        data = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    if int(size.item()):
        dist.broadcast(data, src=0)
    return bytes(data.cpu().tolist()).decode()
