"""What a run does as it starts: quiet ranks other than 0, decide whether it resumes, open its
outputs (metrics trackers, the resolved config, the summary line, the communication profiler);
and the profiled steps' report."""

from __future__ import annotations

import logging
import os
import warnings
from pathlib import Path

from ndparallel.config import TrainConfig
from ndparallel.runtime.comm_profile import CommProfiler
from ndparallel.runtime.quiet import quiet_library_noise
from ndparallel.tracking.run import RunTrackers
from ndparallel.training.metrics import device_peak_flops, global_numel, local_numel, model_flops_per_token


def quiet_non_main_ranks(rank: int) -> None:
    """Warnings and library logs from ranks other than 0 are not repeated N times; notices that do
    not apply here are silenced on every rank (``runtime/quiet.py``)."""

    quiet_library_noise()
    if rank != 0:
        warnings.filterwarnings("ignore")
        logging.getLogger("transformers").setLevel(logging.ERROR)
        logging.getLogger("datasets").setLevel(logging.ERROR)
        os.environ["TRANSFORMERS_VERBOSITY"] = "error"


def resume_policy(resume_from_checkpoint: str | None, env) -> str | None:
    """What to resume from: the config's choice; after an elastic restart (``max_restarts``) the
    newest complete checkpoint even if the config did not ask, so a restarted job continues."""
    if resume_from_checkpoint:
        return resume_from_checkpoint
    return "auto" if int(env.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0 else None


def start_outputs(trainer) -> tuple[RunTrackers, float, float | None, CommProfiler | None]:
    """Metrics file, resolved config, the run's summary line; (the trackers, the model's FLOPs per
    token, the device's peak FLOP/s, the communication profiler when asked for)."""
    engine, cfg = trainer.engine, trainer.cfg
    n_global = global_numel(trainer.model)
    flops_per_token = model_flops_per_token(trainer.model, trainer.hf_config, cfg.sequence_len)
    peak_flops = device_peak_flops(engine.device, cfg.compute_dtype() is not None)
    metrics = RunTrackers(
        trainer.out,
        cfg,
        engine.is_main_process,
        fresh=trainer.state.step == 0,
        config=cfg.model_dump(mode="json", exclude_none=True),
    )
    if engine.is_main_process:
        trainer.out.mkdir(parents=True, exist_ok=True)
        (trainer.out / "config.resolved.yaml").write_text(dump_yaml(cfg))
    engine.print(
        f"ndparallel train: {engine.dims.describe()} on {engine.world_size} rank(s) "
        f"({engine.device.type}); model {n_global / 1e6:.2f}M params "
        f"({local_numel(trainer.model) / 1e6:.2f}M on this rank{trainable_note(cfg, trainer.model)}); "
        f"{trainer.total_steps} steps × "
        f"{trainer.loader.global_micro_batch * cfg.gradient_accumulation_steps} sequences × "
        + (
            f"{cfg.sequence_len} tokens"
            if cfg.pads_to_sequence_len()
            else f"up to {cfg.sequence_len} tokens (each micro-batch cut after its longest row)"
        )
    )
    profiler = None
    if trainer.profile_comm:  # the first two steps (lazy init, then a steady step) are recorded
        profiler = CommProfiler(engine.mesh, engine.built_expert_mesh)
        profiler.__enter__()
    return metrics, flops_per_token, peak_flops, profiler


def trainable_note(cfg: TrainConfig, model) -> str:
    if cfg.adapter is None:
        return ""
    return f"; LoRA: {global_numel(model, trainable_only=True) / 1e6:.3f}M trainable"


def profile_step(engine, profiler, out: Path):
    """Close a profiled step; after the second, print rank 0's table, write every rank's JSON, stop."""
    profiler.step()
    if profiler.num_steps < 2:
        return profiler
    profiler.__exit__(None, None, None)
    (out / "comm_profile").mkdir(parents=True, exist_ok=True)
    (out / "comm_profile" / f"rank-{engine.rank:05d}.json").write_text(profiler.to_json(step=1))
    engine.print(profiler.format_table(step=1, title="collectives per rank, steady step (rank 0)"))
    return None


def dump_yaml(cfg: TrainConfig) -> str:
    import yaml

    return yaml.safe_dump(cfg.model_dump(mode="json", exclude_none=True), sort_keys=False)
