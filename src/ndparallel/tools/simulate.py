"""``ndparallel simulate``: run rank R of an N-rank world in this process, over torch's fake
process-group backend (``runtime/fake_world.py``), and measure it: the training config's model
built as ``train`` builds it (meta → parallelise → only this rank's shards materialised, filled
with random values), the real data path and loader shard, the real ``train_step`` (optimizer,
accumulation, activation checkpointing, chunked loss, LoRA, fp8, compile: what the config says).

Collectives return at once without data: they cost nothing here and every value that went
through one is garbage, so losses are never reported. What is real and reported: peak memory,
the compute time of a step, the collectives this rank issues per mesh dimension (calls and
bytes), and the planner's prediction for the same layout and settings beside them
(``tools/simulate_predict.py``).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ndparallel.axolotl import load_config
from ndparallel.config import TrainConfig
from ndparallel.data import PackedLoader
from ndparallel.engine import batch_to_device, train_step
from ndparallel.engine.model_build import build_random_shards
from ndparallel.models.attention import attention_kernel
from ndparallel.models.presets import is_preset
from ndparallel.preflight.model_check import resolve_model_config
from ndparallel.preflight.padding import loader_row_length
from ndparallel.runtime.comm_profile import CommProfiler
from ndparallel.runtime.distributed import shutdown
from ndparallel.runtime.fake_world import start_fake_world
from ndparallel.runtime.memory_probe import LiveBytes, peak_rss_bytes, reset_peak_rss, state_bytes
from ndparallel.runtime.quiet import quiet_library_noise
from ndparallel.techniques.offload import offloader_of
from ndparallel.tools.simulate_pipeline import DirectSchedule, build_random_stages, pipeline_report
from ndparallel.tools.simulate_predict import compare_collectives, predict
from ndparallel.training.components import rounded_vocab
from ndparallel.training.metrics import global_numel
from ndparallel.training.trainer import Trainer

GiB = 2**30


@dataclass(frozen=True)
class SimulationRequest:
    world_size: int
    rank: int = 0
    steps: int = 3
    """Timed steps (after one warm-up step; one more step is profiled for memory and collectives)."""
    gpus_per_node: int = 8
    gpu_mem: float | None = None
    """Device memory budget in bytes: the layout fits if the measured peak is at most this."""
    hardware_file: str | None = None
    gpu: str | None = None
    save_checkpoint: str | None = None
    """A directory to write this rank's shards of a DCP checkpoint to (time and bytes measured)."""


class SimulatedTrainer(Trainer):
    """The trainer's own setup (engine, tokenizer, data, loader, optimizer, schedule) with the
    model's weights random and only this rank's shards ever materialised."""

    def _load_model(self):

        cfg, engine = self.cfg, self.engine
        kernel, _ = attention_kernel(cfg.attn_implementation, engine.device.type)
        # a preset, a directory holding only config.json, or a published model's shape (offline)
        self.hf_config = resolve_model_config(cfg)
        if is_preset(cfg.base_model):  # a row per token of the run's tokenizer, as train builds it
            self.hf_config.vocab_size = rounded_vocab(cfg, len(self.tokenizer))
        self.hf_config.use_cache = False
        adapter = cfg.lora_config_from_fields()  # a saved adapter's shape would need its files
        dtype = torch.bfloat16 if adapter is not None and cfg.bf16 else torch.float32
        if engine.dims.pp_enabled:  # this rank's pipeline stages only
            return build_random_stages(engine, self.hf_config, dtype, kernel, cfg.trust_remote_code)
        return build_random_shards(
            engine,
            self.hf_config,
            dtype=dtype,
            attn_implementation=kernel,
            trust_remote_code=cfg.trust_remote_code,
            adapter=adapter,
        )


def simulate(cfg: TrainConfig, req: SimulationRequest) -> dict:
    """Start the fake world, set up and run the steps, measure, predict; return the report dict
    (``report.py`` prints it). Runs in this process; leaves no process group behind."""

    start_fake_world(req.world_size, req.rank)
    try:
        # A rank's process starts here: the pre-launch checks and data preparation this process
        # did first happen in the launcher of a real job, not in the ranks.
        reset_peak_rss()
        baseline_rss = peak_rss_bytes()
        trainer = SimulatedTrainer(cfg)
        trainer.setup()
        rows = loader_row_length(cfg, trainer.loader)
        pipeline = _direct_pipeline(trainer)
        measured, profiler = _measure(trainer, req.steps, rows.tokens)
        measured["runtime_rss_gib"] = baseline_rss / GiB
        if req.save_checkpoint:
            measured["checkpoint"] = _save_checkpoint(trainer, Path(req.save_checkpoint))
        predicted, planned = predict(trainer, req, measured, rows.tokens)
        collectives, predicted_collectives = compare_collectives(profiler, planned, trainer.engine)
        if pipeline is not None:
            measured["pipeline"] = pipeline_report(trainer, measured)
    finally:
        shutdown()
    engine = trainer.engine
    out = {
        "layout": {
            **engine.dims.to_dict(),
            "describe": engine.dims.describe(),
            "world_size": req.world_size,
            "rank": req.rank,
            "device": engine.device.type,
        },
        "model": {"name": cfg.base_model, "params": measured.pop("global_params")},
        "settings": {
            "sequence_len": cfg.sequence_len,
            "row_length": rows.tokens,
            "rows": rows.text,
            "micro_batch_size": cfg.micro_batch_size,
            "gradient_accumulation_steps": cfg.gradient_accumulation_steps,
            "steps": req.steps,
        },
        "measured": measured,
        "predicted": predicted,
        "collectives": collectives,
        "predicted_collectives": predicted_collectives,
        "note": "collectives cost nothing under the fake backend (step times are compute only) and carry no "
        "data: losses are meaningless and not reported",
    }
    out["fits"] = _fits(out, req.gpu_mem)
    return out


def _direct_pipeline(trainer: Trainer):
    """Under pipeline parallel: this rank's stages run directly (``tools/simulate_pipeline.py``:
    torch's schedules cannot start over the fake backend); None otherwise."""
    engine = trainer.engine
    if not engine.dims.pp_enabled:
        return None

    direct = DirectSchedule(engine, engine.pipeline_of(trainer.model))
    direct.install()
    return direct


def _steps_batches(trainer: Trainer, step: int, width: int) -> list:
    """Step ``step``'s micro-batches, rows of whole samples cut at ``width`` (the one width the
    planner is asked about: ``preflight/padding.py``'s ``loader_row_length``)."""
    ga, device = trainer.cfg.gradient_accumulation_steps, trainer.engine.device
    loader = trainer.loader
    cut = {"width": width} if isinstance(loader, PackedLoader) else {}  # a stream: full blocks
    return [batch_to_device(loader.micro_batch(step * ga + m, **cut), device) for m in range(ga)]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _measure(trainer: Trainer, steps: int, width: int) -> tuple[dict, object]:
    """One warm-up step, ``steps`` timed steps, one profiled step (collectives; on CPU the tensor
    bytes alive), every micro-batch ``width`` tokens wide. Returns the measurements and the
    communication profiler."""

    engine, model, cfg = trainer.engine, trainer.model, trainer.cfg
    model.train()
    torch.set_flush_denormal(True)  # garbage from fake collectives must not hit slow denormal paths

    def step(i: int):
        return train_step(
            engine,
            model,
            trainer.optimizer,
            _steps_batches(trainer, i, width),
            scheduler=trainer.scheduler,
            max_grad_norm=cfg.max_grad_norm,
        )

    step(0)  # lazy initialisation (FSDP, compile, optimizer states)
    if engine.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(engine.device)
    times = []
    for i in range(1, steps + 1):
        _sync(engine.device)
        t0 = time.perf_counter()
        step(i)
        _sync(engine.device)
        times.append(time.perf_counter() - t0)
    states = state_bytes(model, trainer.optimizer)
    live = LiveBytes() if engine.device.type == "cpu" else None
    with CommProfiler(engine.mesh) as profiler:
        if live is not None:
            with live:
                step(steps + 1)
        else:
            step(steps + 1)
        profiler.step()
    if engine.device.type == "cuda":
        tensors = torch.cuda.max_memory_allocated(engine.device)
        peak = tensors
    else:
        tensors = sum(states.values()) + live.peak
        peak = peak_rss_bytes()
    out = {
        "peak_memory_gib": peak / GiB,
        "tensor_peak_gib": tensors / GiB,
        "state_gib": {k: v / GiB for k, v in states.items()},
        "step_time_s": statistics.median(times),
        "step_times_s": times,
        "global_params": global_numel(model),
    }
    offloader = offloader_of(model)
    if offloader is not None:  # pinned host memory on a GPU: not in the tensor peak (memory_probe.py)
        out["offload_host_peak_gib"] = offloader.stats.peak_host_bytes / GiB
    return out, profiler


def _save_checkpoint(trainer: Trainer, directory: Path) -> dict:
    """Write this rank's shards of the model and optimizer state with DCP, as a lone process
    (``no_dist``: no coordination through the fake collectives); time and bytes written."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(trainer.model, trainer.optimizer)
    directory = directory / f"rank-{trainer.engine.rank:05d}"
    directory.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    dcp.save(
        {"model": model_sd, "optimizer": optim_sd},
        storage_writer=dcp.FileSystemWriter(directory),
        no_dist=True,
    )
    seconds = time.perf_counter() - t0
    written = sum(f.stat().st_size for f in directory.rglob("*") if f.is_file())
    return {"seconds": seconds, "bytes": written, "gib": written / GiB, "path": str(directory)}


def run_in_child(config: str | None, overrides: list[str], req: SimulationRequest) -> dict:
    """``simulate`` in a fresh Python process, as a rank of a real job starts (the pre-launch
    checks and data preparation of this process stay out of the rank's memory); its report."""
    import dataclasses
    import json
    import os
    import subprocess
    import sys
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "report.json"
        args = [
            sys.executable,
            "-m",
            "ndparallel.tools.simulate",
            json.dumps(dataclasses.asdict(req)),
            str(out),
            config or "",
            *overrides,
        ]
        run = subprocess.run(args, env=os.environ.copy())
        if run.returncode != 0 or not out.is_file():
            raise RuntimeError(f"the simulated rank failed (exit {run.returncode}); its error is above")
        return json.loads(out.read_text())


def _child_main(argv: list[str]) -> None:
    import json

    quiet_library_noise()
    req = SimulationRequest(**json.loads(argv[0]))
    cfg = load_config(argv[2] or None, argv[3:])
    Path(argv[1]).write_text(json.dumps(simulate(cfg, req)))


def _fits(report: dict, gpu_mem: float | None) -> bool | None:
    """Does the measured peak fit ``gpu_mem`` (None: no budget given)?"""
    if gpu_mem is None:
        return None
    return report["measured"]["peak_memory_gib"] * GiB <= gpu_mem


if __name__ == "__main__":
    import sys

    _child_main(sys.argv[1:])
