"""A small training run that saves and resumes checkpoints, for the checkpoint and fault tests.

Imported by the tests (``train`` runs inside a rank of ``run_on_ranks``) and launched as a script:
``ndparallel launch --nproc-per-node 2 [--max-restarts 1] ckpt_train.py OUT --steps 4 [--kill-at 2
--kill-rank 1 --marker FILE] [--hang-at 2]``: it resumes from OUT's newest complete checkpoint,
saves one every step, and rank 0 writes ``OUT/losses.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import time

import torch
import torch.distributed as dist

TOTAL_STEPS = 4
NUM_BLOCKS, SEQ, GLOBAL_MB = 64, 32, 4


def make_setup():
    from ndparallel.models.presets import preset_config
    from ndparallel.tools.equivalence import TrainSetup

    return TrainSetup(
        model_config=preset_config("tiny-llama"),
        steps=TOTAL_STEPS,
        seq_len=SEQ,
        global_micro_batch=GLOBAL_MB,
        lr=1e-2,
    )


def train(
    layout: dict | None,
    out_dir: str,
    *,
    steps: int = TOTAL_STEPS,
    resume: bool = False,
    save_every: int | None = None,
    stop_after: int | None = None,
    save_total_limit: int | None = None,
    kill_at: int | None = None,
    kill_rank: int = 1,
    marker: str | None = None,
    reseed_before_load: bool = False,
    model_preset: str = "tiny-llama",
    adapter: dict | None = None,
    optimizer: str | None = None,
    optimizer_options: dict | None = None,
    async_saves: bool = False,
    slow_write: dict | None = None,
    sync_copy_at: int | None = None,
    die_after_save_at: int | None = None,
    signal_at: tuple[int, int] | None = None,
) -> dict:
    """Train ``steps`` optimizer steps (resuming first if asked); returns losses by step, the first
    random numbers drawn after the last save / the load, and the loader position.

    ``async_saves``: checkpoints through an ``AsyncCheckpointer`` (``slow_write``: {step: seconds}
    the writer sleeps before writing that step's files; ``sync_copy_at``: also save that step
    synchronously to ``out_dir/sync-copy``; ``die_after_save_at``: every rank dies right after
    starting that step's save, its write still in flight). ``signal_at=(rank, step)``: that rank
    sends itself SIGUSR1 after that step; the loop runs under ``acc.preemption()`` and, when the
    ranks agree to stop, saves a checkpoint and returns (``stopped``: step, signal)."""
    from ndparallel import Accelerator, ParallelismConfig
    from ndparallel.checkpoint import (
        find_resume_checkpoint,
        load_checkpoint,
        save_checkpoint,
        save_step_checkpoint,
    )
    from ndparallel.data.loader import PackedLoader
    from ndparallel.engine import forward_backward
    from ndparallel.models.presets import preset_config
    from ndparallel.tools.equivalence import (
        build_model,
        setup_optimizer,
        with_overrides,
    )

    setup = with_overrides(make_setup(), model_config=preset_config(model_preset), adapter=adapter)
    if optimizer is not None:
        setup = with_overrides(setup, optimizer=optimizer, optimizer_options=optimizer_options or {})
    acc = Accelerator(ParallelismConfig(**(layout or {})))
    model = build_model(setup)
    optimizer = setup_optimizer(
        setup, model if setup.optimizer == "muon" else model.parameters()
    )  # muon: the model
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1.0 + s))
    model, optimizer = acc.prepare(model, optimizer)
    model.train()
    blocks = torch.randint(
        0, setup.model_config.vocab_size, (NUM_BLOCKS, SEQ + 1), generator=torch.Generator().manual_seed(7)
    )
    loader = PackedLoader(blocks, GLOBAL_MB // acc.dp_size, dp_rank=acc.dp_rank, dp_size=acc.dp_size, seed=3)
    start, rng_probe = 0, None
    if resume:
        ckpt = find_resume_checkpoint(out_dir, "auto")
        if ckpt is not None:
            if reseed_before_load:
                torch.manual_seed(12345)
            extra = load_checkpoint(ckpt, model, optimizer, scheduler, loader=loader)
            start = extra["step"]
            rng_probe = torch.rand(4).tolist()
            assert extra["config"]["name"] == "ckpt-test" and extra["note"] == [1, 2]
    losses: dict[int, float] = {}
    batches = iter(loader)
    saver = _async_saver(slow_write or {}) if async_saves else None
    watch = acc.preemption(timeout_s=120) if signal_at is not None else None
    stopped = None
    with watch if watch is not None else contextlib.nullcontext():
        for step in range(start + 1, steps + 1):
            mb = {k: v.to(acc.device) for k, v in next(batches).items()}
            loss = forward_backward(acc.engine, model, [mb])
            acc.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            total = loss.clone()
            dist.all_reduce(total, group=acc.mesh("dp_cp").get_group())
            losses[step] = float(total)
            if save_every and step % save_every == 0:
                save = saver.save_step if saver is not None else save_step_checkpoint
                kwargs = dict(
                    loader=loader,
                    config={"name": "ckpt-test", "layout": layout},
                    extra={"note": [1, 2]},
                    save_total_limit=save_total_limit,
                    layout=acc.engine.dims,
                )
                save(out_dir, step, model, optimizer, scheduler, **kwargs)
                if sync_copy_at == step:
                    kwargs.pop("save_total_limit")
                    save_checkpoint(
                        os.path.join(out_dir, "sync-copy"),
                        model,
                        optimizer,
                        scheduler,
                        kwargs.pop("extra"),
                        step=step,
                        **kwargs,
                    )
                if die_after_save_at == step:
                    os._exit(3)
                rng_probe = torch.rand(4).tolist()
            if (
                kill_at == step
                and acc.process_index == kill_rank
                and (marker is None or not os.path.exists(marker))
            ):
                if marker is not None:
                    open(marker, "w").close()
                os.kill(os.getpid(), signal.SIGKILL)
            if stop_after == step:
                break
            if signal_at is not None and signal_at == (acc.process_index, step):
                os.kill(os.getpid(), signal.SIGUSR1)
            if watch is not None and watch.should_stop():
                save_step_checkpoint(
                    out_dir,
                    step,
                    model,
                    optimizer,
                    scheduler,
                    loader=loader,
                    config={"name": "ckpt-test", "layout": layout},
                    extra={"note": [1, 2]},
                    layout=acc.engine.dims,
                )
                watch.finished()
                stopped = (step, watch.signal_name)
                break
    if saver is not None:
        saver.close()  # the last save is awaited
    out = {
        "losses": losses,
        "rng_probe": rng_probe,
        "loader": loader.state_dict(),
        "lr": scheduler.get_last_lr(),
        "stopped": stopped,
    }
    if adapter is not None:  # the trained model's logits on a fixed batch, and its exports
        out["logits"] = _logits(acc, model, setup.model_config.vocab_size)
        acc.save_model(model, os.path.join(out_dir, "adapter"))
        from ndparallel.checkpoint.export import save_hf_model

        save_hf_model(model, os.path.join(out_dir, "merged"), acc.is_main_process, merge_adapter=True)
    return out


def _async_saver(slow_write: dict):
    """An ``AsyncCheckpointer`` whose writer sleeps ``slow_write[step]`` seconds before writing
    ``checkpoint-{step}`` (a slow filesystem: training goes on meanwhile)."""
    import torch.distributed.checkpoint as dcp

    from ndparallel.checkpoint import AsyncCheckpointer

    class SlowWriter(dcp.FileSystemWriter):
        def write_data(self, plan, planner):
            step = int(str(self.path).rsplit("-", 1)[-1])
            time.sleep(slow_write.get(step, 0))
            return super().write_data(plan, planner)

    return AsyncCheckpointer(writer=lambda d: SlowWriter(d, single_file_per_rank=True))


def probe_batch(vocab_size: int) -> torch.Tensor:
    return torch.randint(0, vocab_size, (2, SEQ), generator=torch.Generator().manual_seed(11))


def _logits(acc, model, vocab_size: int) -> torch.Tensor:
    """Full logits of ``probe_batch`` (every rank the same batch; layouts without CP)."""
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=probe_batch(vocab_size).to(acc.device)).logits
    model.train()
    return (logits.full_tensor() if hasattr(logits, "full_tensor") else logits).float().cpu()


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("out_dir")
    p.add_argument("--steps", type=int, default=TOTAL_STEPS)
    p.add_argument("--kill-at", type=int, default=None)
    p.add_argument("--kill-rank", type=int, default=1)
    p.add_argument("--marker", default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    from ndparallel.runtime.distributed import init_distributed, shutdown

    init_distributed("cpu")
    result = train(
        {"dp_shard_size": dist.get_world_size()},
        args.out_dir,
        steps=args.steps,
        resume=True,
        save_every=1,
        save_total_limit=2,
        kill_at=args.kill_at,
        kill_rank=args.kill_rank,
        marker=args.marker,
    )
    if dist.get_rank() == 0:
        path = os.path.join(args.out_dir, "losses.json")
        old = json.load(open(path)) if os.path.exists(path) else {}
        old.update({str(k): v for k, v in result["losses"].items()})
        json.dump(old, open(path, "w"))
    shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
