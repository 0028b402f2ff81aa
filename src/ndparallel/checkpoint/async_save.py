"""Asynchronous checkpoints: training continues while the previous checkpoint is written.

``AsyncCheckpointer.save`` does synchronously what is small (the directory, ``state.json``, the RNG
files, the HF config) and stages this rank's tensors to host memory — on CUDA into pinned buffers
on a side stream (the copy overlaps the next forward/backward; the next optimizer step waits for
it, so no parameter changes under the copy), on CPU a plain host copy. DCP then writes the staged
copy from a background thread over its own gloo group (so its collectives never interleave with
the training thread's), and returns. Rules, the same as for a synchronous save:

* at most one save in flight: a new ``save`` first waits for the previous one;
* ``COMPLETE`` only after the write finished: DCP's last step gathers every rank's write results
  on rank 0 before it writes ``.metadata``, so when rank 0's write returns, every rank's files are
  on disk; rank 0 then writes the marker (atomically) from the background thread;
* rotation (``save_total_limit``) only after that marker exists;
* a crash during the write leaves a directory without a marker: the previous complete
  checkpoint stays the resume point (``find_resume_checkpoint`` skips it);
* ``wait()`` / ``close()`` at the end of training: the last save is awaited.

Host memory: one staged copy of this rank's model and optimizer shards, kept for reuse between
saves (pinned on CUDA; ``bench/checkpoint_async.py`` measures it).
"""

from __future__ import annotations

import datetime
import os
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from ndparallel.checkpoint.directory import checkpoint_dir, rotate_checkpoints, write_marker
from ndparallel.checkpoint.state import collect_state, start_save


class AsyncCheckpointer:
    """Writes checkpoints in the background, one at a time. Every rank makes one and calls
    ``save`` / ``save_step`` at the same steps. ``pin_memory``: stage into pinned host memory
    (default: when CUDA tensors are saved). ``timeout_s``: of the writer's gloo group (default:
    ``NDPARALLEL_TIMEOUT`` or 600). ``writer``: ``directory -> StorageWriter`` (default: DCP's
    ``FileSystemWriter``, one file per rank; e.g. an object-store writer)."""

    def __init__(self, pin_memory: bool | None = None, timeout_s: float | None = None, writer=None):
        self.pin_memory = pin_memory
        self.timeout_s = timeout_s or float(os.environ.get("NDPARALLEL_TIMEOUT", 600))
        self.writer = writer or (lambda d: dcp.FileSystemWriter(d, single_file_per_rank=True))
        self._group = None
        self._stager = None
        self._pending: _Pending | None = None
        self._staging = None
        self._hooks: list = []
        self.last_complete: Path | None = None
        self.last_step: int | None = None  # step of the last save started

    @property
    def in_flight(self) -> bool:
        return self._pending is not None and not self._pending.done.is_set()

    # ----------------------------------------------------------------------- saving
    def save(
        self,
        directory,
        models: Sequence = (),
        optimizers: Sequence = (),
        schedulers: Sequence = (),
        extra: dict | None = None,
        *,
        loaders: Sequence = (),
        step: int | None = None,
        config: Any = None,
        layout=None,
        save_total_limit: int | None = None,
    ) -> Path:
        """Start writing a checkpoint of these objects into ``directory`` (as ``save_state``);
        returns once their state is staged. ``save_total_limit``: rotate ``directory``'s parent
        once it is complete."""
        self.wait()
        directory = Path(directory)
        tensors, state = collect_state(models, optimizers, schedulers, extra, loaders, step, config, layout)
        start_save(directory, state, models)
        self._setup(tensors)
        response = dcp.async_save(
            tensors,
            storage_writer=self.writer(directory),
            process_group=self._group,
            async_stager=self._stager,
        )
        upload = getattr(response, "upload_completion", response)
        staging = getattr(response, "staging_completion", None)
        if staging is not None and not staging.done():
            self._hooks = [o.register_step_pre_hook(self._wait_staging) for o in optimizers]
            self._staging = staging
        rotate = (
            (lambda: rotate_checkpoints(directory.parent, save_total_limit, background=True))
            if save_total_limit is not None
            else None
        )
        self._pending = _Pending(directory, state, upload, rotate)
        self.last_step = state["step"]
        return directory

    def save_step(
        self,
        output_dir,
        step: int,
        model,
        optimizer,
        scheduler=None,
        *,
        loader=None,
        config: Any = None,
        extra: dict | None = None,
        save_total_limit: int | None = None,
        layout=None,
    ) -> Path:
        """``output_dir/checkpoint-{step}``, asynchronously (as ``save_step_checkpoint``)."""
        return self.save(
            checkpoint_dir(output_dir, step),
            [model],
            [optimizer] if optimizer is not None else [],
            [scheduler] if scheduler is not None else [],
            extra,
            step=step,
            config=config,
            loaders=[loader] if loader is not None else [],
            layout=layout,
            save_total_limit=save_total_limit,
        )

    def wait(self) -> Path | None:
        """Block until the save in flight (if any) is complete; returns its directory. Raises its
        error (on the ranks where it failed: every rank, when a write failed anywhere)."""
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        self._wait_staging()
        pending.done.wait()
        if pending.error is not None:
            raise pending.error
        self.last_complete = pending.directory
        return pending.directory

    def close(self) -> Path | None:
        """Await the last save and free the staging buffers."""
        try:
            return self.wait()
        finally:
            if self._stager is not None:
                self._stager.close()
                self._stager = None

    # --------------------------------------------------------------------- internals
    def _setup(self, tensors: dict) -> None:
        if self._group is None and dist.is_initialized() and dist.get_world_size() > 1:
            self._group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=self.timeout_s))
        if self._stager is None:
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

            on_cuda = any(_is_cuda(t) for t in tensors.values())
            pin = on_cuda if self.pin_memory is None else (self.pin_memory and torch.cuda.is_available())
            self._stager = DefaultStager(
                StagingOptions(
                    use_pinned_memory=pin,
                    use_shared_memory=False,
                    use_async_staging=on_cuda,
                    use_non_blocking_copy=on_cuda,
                )
            )

    def _wait_staging(self, *_args) -> None:
        if self._staging is not None:
            self._staging.result()
            self._staging = None
        for h in self._hooks:
            h.remove()
        self._hooks = []


class _Pending:
    """One save being written: a thread waits for DCP's write, then (rank 0) marks it complete
    and rotates."""

    def __init__(self, directory: Path, state: dict, upload, rotate):
        self.directory, self.state, self.upload, self.rotate = directory, state, upload, rotate
        self.error: BaseException | None = None
        self.done = threading.Event()
        self.started = time.perf_counter()
        threading.Thread(target=self._finish, name="ndparallel-checkpoint-finish", daemon=True).start()

    def _finish(self) -> None:
        try:
            self.upload.result()
            if not dist.is_initialized() or dist.get_rank() == 0:
                write_marker(self.directory, self.state)
                if self.rotate is not None:
                    self.rotate()
        except BaseException as exc:  # noqa: BLE001 - handed to wait()
            self.error = exc
        finally:
            self.done.set()


def _is_cuda(t) -> bool:
    local = t.to_local() if hasattr(t, "to_local") else t
    return isinstance(local, torch.Tensor) and local.is_cuda
