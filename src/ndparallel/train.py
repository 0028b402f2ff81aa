"""The loop behind ``ndparallel train``: runs on every rank of an already started job."""

from __future__ import annotations

import logging
import math
import os
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from ndparallel.config import TrainConfig
from ndparallel.step import forward_backward
from ndparallel.metrics import (
    MetricsWriter, device_peak_flops, model_flops_per_token, peak_memory_gb,
)


@dataclass
class TrainState:
    step: int = 0
    samples_seen: int = 0  # global samples consumed: resumes on any layout


def quiet_non_main_ranks(rank: int) -> None:
    """Warnings and library logs from ranks other than 0 are not repeated N times; two torch notices
    that do not apply here are silenced on every rank: FSDP2's "returned a view tensor" (transformers'
    decoder applies no in-place op to those outputs; the equivalence tests prove the gradients) and
    DTensor's "sequential all_gather" note when export gathers FSDP × TP parameters."""
    warnings.filterwarnings("ignore", message=".*returned a view tensor.*")
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    if rank != 0:
        warnings.filterwarnings("ignore")
        logging.getLogger("transformers").setLevel(logging.ERROR)
        logging.getLogger("datasets").setLevel(logging.ERROR)
        os.environ["TRANSFORMERS_VERBOSITY"] = "error"


def load_tokenizer(cfg: TrainConfig, cache_dir: Path):
    from ndparallel.data import load_or_train_tokenizer
    from ndparallel.models.presets import is_preset

    source = cfg.tokenizer or ("builtin:stdlib" if is_preset(cfg.base_model) else cfg.base_model)
    kwargs = {}
    if source == "builtin:stdlib":
        kwargs["vocab_size"] = cfg.tokenizer_vocab_size
        for d in cfg.datasets:  # train on the same slice of the corpus the data uses
            if d.path == "builtin:stdlib":
                kwargs.update(max_files=d.max_files, max_bytes=d.max_bytes)
    return load_or_train_tokenizer(source, cache_dir=cache_dir, **kwargs)


def model_config(cfg: TrainConfig, vocab_size: int | None = None):
    """The HF config of ``base_model``: a preset (vocab sized to the tokenizer) or a directory/id."""
    from transformers import AutoConfig

    from ndparallel.models.presets import is_preset, preset_config

    if is_preset(cfg.base_model):
        return preset_config(cfg.base_model, **({"vocab_size": vocab_size} if vocab_size else {}))
    return AutoConfig.from_pretrained(cfg.base_model, trust_remote_code=cfg.trust_remote_code)


def resume_policy(resume_from_checkpoint: str | None, env) -> str | None:
    """What to resume from: the config's choice; after an elastic restart (``max_restarts``) the
    newest complete checkpoint even if the config did not ask, so a restarted job continues."""
    if resume_from_checkpoint:
        return resume_from_checkpoint
    return "auto" if int(env.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0 else None


def build_optimizer(cfg: TrainConfig, params):
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(params, lr=cfg.learning_rate, weight_decay=cfg.weight_decay)
    return torch.optim.AdamW(
        params, lr=cfg.learning_rate, betas=(cfg.adam_beta1, cfg.adam_beta2),
        eps=cfg.adam_epsilon, weight_decay=cfg.weight_decay,
    )


def build_scheduler(cfg: TrainConfig, optimizer, total_steps: int):
    from transformers import get_scheduler

    name = {"cosine": "cosine", "linear": "linear", "constant": "constant_with_warmup"}[cfg.lr_scheduler]
    return get_scheduler(name, optimizer, num_warmup_steps=cfg.warmup_steps,
                         num_training_steps=total_steps)


def run_training(cfg: TrainConfig, profile_comm: bool = False) -> dict:
    """Train per ``cfg`` on the current process group; returns the final metrics (main rank)."""
    from ndparallel import Accelerator
    from ndparallel.data import PackedLoader, build_blocks

    acc = Accelerator(
        cfg.parallelism_config(), mixed_precision="bf16" if cfg.bf16 else "no",
        gradient_accumulation_steps=cfg.gradient_accumulation_steps,
        fsdp_options=cfg.fsdp_options(), tp_options=cfg.tp_options(), cp_options=cfg.cp_options(),
        device=None if cfg.device == "auto" else cfg.device, timeout_s=cfg.collective_timeout_s,
    )
    quiet_non_main_ranks(acc.process_index)
    out = Path(cfg.output_dir)
    cache_dir = Path(cfg.dataset_cache_dir or out.parent / ".cache")
    torch.manual_seed(cfg.seed)

    # ---- data: every rank builds the same blocks (cached, file-locked); dp ranks take their share
    tokenizer = load_tokenizer(cfg, cache_dir)
    splits = build_blocks([d.model_dump() for d in cfg.datasets], tokenizer, cfg.sequence_len,
                          val_set_size=cfg.val_set_size, seed=cfg.seed, cache_dir=cache_dir)
    loader = PackedLoader(splits.train, cfg.micro_batch_size, dp_rank=acc.dp_rank,
                          dp_size=acc.dp_size, seed=cfg.seed)
    global_micro = loader.global_micro_batch
    steps_per_epoch = len(loader) // cfg.gradient_accumulation_steps
    total_steps = cfg.max_steps or max(1, math.floor(cfg.num_epochs * steps_per_epoch))

    # ---- model, optimizer, schedule
    hf_config = model_config(cfg, vocab_size=len(tokenizer))
    hf_config.use_cache = False
    model = acc.load_model(cfg.base_model if not _is_preset(cfg) else hf_config, seed=cfg.seed,
                           trust_remote_code=cfg.trust_remote_code)
    optimizer = build_optimizer(cfg, model.parameters())
    scheduler = build_scheduler(cfg, optimizer, total_steps)
    state = TrainState()

    # ---- resume (any layout: DCP reshards model and optimizer; data resumes by samples seen)
    resume = resume_policy(cfg.resume_from_checkpoint, os.environ)
    if resume:
        from ndparallel.checkpoint import find_resume_checkpoint, load_checkpoint

        try:
            ckpt = find_resume_checkpoint(out, resume)
        except ValueError as e:
            raise SystemExit(f"ndparallel train: error: resume_from_checkpoint: {e}") from None
        if ckpt is not None:
            extra = load_checkpoint(acc, ckpt, model, optimizer, scheduler)
            state = TrainState(step=int(extra["step"]), samples_seen=int(extra["samples_seen"]))
            acc.print(f"resumed from {ckpt} at step {state.step}")

    num_params = _local_numel(model)
    flops_per_token = model_flops_per_token(
        _global_numel(model), hf_config.num_hidden_layers, hf_config.hidden_size, cfg.sequence_len)
    peak = device_peak_flops(acc.device, cfg.bf16)
    metrics = MetricsWriter(out / "metrics.jsonl", acc.is_main_process)
    if acc.is_main_process:
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.resolved.yaml").write_text(_dump_yaml(cfg))
        if state.step == 0 and metrics.path.exists():
            metrics.path.unlink()  # a fresh run starts a fresh metrics file
    acc.print(
        f"ndparallel train: {acc.parallelism_config.describe()} on {acc.num_processes} rank(s) "
        f"({acc.device.type}); model {_global_numel(model) / 1e6:.2f}M params "
        f"({num_params / 1e6:.2f}M on this rank); {total_steps} steps × "
        f"{global_micro * cfg.gradient_accumulation_steps} sequences × {cfg.sequence_len} tokens"
    )

    profiler = None
    if profile_comm:  # the first two steps (lazy init, then a steady step) are recorded
        from ndparallel.comm_profile import CommProfiler

        profiler = CommProfiler(acc.torch_device_mesh)
        profiler.__enter__()

    model.train()
    progress = _Progress(total_steps, state.step, enabled=acc.is_main_process)
    dp_cp_group = acc.mesh("dp_cp").get_group()
    last = {}
    try:
        while state.step < total_steps:
            t0 = time.perf_counter()
            first_micro = state.samples_seen // global_micro
            micro_batches = [loader.micro_batch(first_micro + m)
                             for m in range(cfg.gradient_accumulation_steps)]
            micro_batches = [{k: v.to(acc.device) for k, v in mb.items()} for mb in micro_batches]
            loss_sum = forward_backward(acc, model, micro_batches)
            grad_norm = (acc.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
                         if cfg.max_grad_norm else acc.grad_norm(model.parameters()))
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            dist.all_reduce(loss_sum, group=dp_cp_group)
            if profiler is not None:
                profiler = _profile_step(acc, profiler, out)
            state.step += 1
            state.samples_seen += global_micro * cfg.gradient_accumulation_steps
            dt = time.perf_counter() - t0
            tokens = global_micro * cfg.gradient_accumulation_steps * cfg.sequence_len
            last = {
                "step": state.step, "loss": float(loss_sum), "lr": scheduler.get_last_lr()[0],
                "grad_norm": float(grad_norm), "step_time_s": dt, "tokens_per_s": tokens / dt,
                "tokens_per_s_per_device": tokens / dt / acc.num_processes,
                "tflops_per_device": flops_per_token * tokens / dt / acc.num_processes / 1e12,
                "peak_memory_gb": peak_memory_gb(acc.device),
            }
            if peak:
                last["mfu"] = last["tflops_per_device"] * 1e12 / peak
            if state.step % cfg.logging_steps == 0 or state.step in (1, total_steps):
                metrics.write(last)
                progress.update(state.step, last)
            if cfg.eval_steps and splits.val is not None and (
                state.step % cfg.eval_steps == 0 or state.step == total_steps
            ):
                ev = evaluate(acc, model, splits.val, cfg)
                metrics.write({"step": state.step, **ev})
                acc.print(f"step {state.step}: eval_loss {ev['eval_loss']:.4f} "
                          f"perplexity {ev['eval_perplexity']:.2f}")
            if cfg.save_steps and state.step % cfg.save_steps == 0:
                _save(acc, cfg, model, optimizer, scheduler, state)
    finally:
        progress.close()
    if cfg.save_final_model:
        final = out / "final"
        acc.save_model(model, str(final), tokenizer=tokenizer)
        acc.print(f"saved the trained model to {final} (AutoModelForCausalLM.from_pretrained loads it)")
    if acc.is_main_process:
        _plot_curves(out)
    acc.end_training()
    return last


@torch.no_grad()
def evaluate(acc, model, val_blocks: torch.Tensor, cfg: TrainConfig) -> dict:
    """Token-weighted loss and perplexity over the validation blocks (sharded over dp ranks)."""
    from ndparallel.data import PackedLoader

    model.eval()
    loader = PackedLoader(val_blocks, cfg.micro_batch_size, dp_rank=acc.dp_rank,
                          dp_size=acc.dp_size, seed=cfg.seed, shuffle=False)
    batches = [{k: v.to(acc.device) for k, v in mb.items()} for mb in loader]
    n_items = acc.global_num_items(batches)
    total = torch.zeros((), device=acc.device)
    for mb in batches:
        with acc.maybe_context_parallel(
            buffers=[mb["input_ids"], mb["shift_labels"], mb["position_ids"]], buffer_seq_dims=[1, 1, 1]
        ):
            logits = model(input_ids=mb["input_ids"], position_ids=mb["position_ids"]).logits
            total += acc.causal_lm_loss(logits, mb["shift_labels"], n_items).float()
    dist.all_reduce(total, group=acc.mesh("dp_cp").get_group())
    model.train()
    loss = float(total)
    return {"eval_loss": loss, "eval_perplexity": math.exp(min(loss, 50.0))}


def _save(acc, cfg, model, optimizer, scheduler, state: TrainState) -> None:
    from ndparallel.checkpoint import save_step_checkpoint

    path = save_step_checkpoint(
        acc, cfg.output_dir, state.step, model, optimizer, scheduler,
        config=cfg.model_dump(mode="json"), extra={"samples_seen": state.samples_seen},
        save_total_limit=cfg.save_total_limit,
    )
    acc.print(f"step {state.step}: checkpoint saved to {path}")


def _profile_step(acc, profiler, out: Path):
    """Close a profiled step; after the second, print rank 0's table, write every rank's JSON, stop."""
    profiler.step()
    if profiler.num_steps < 2:
        return profiler
    profiler.__exit__(None, None, None)
    (out / "comm_profile").mkdir(parents=True, exist_ok=True)
    (out / "comm_profile" / f"rank-{acc.process_index:05d}.json").write_text(profiler.to_json(step=1))
    acc.print(profiler.format_table(step=1, title="collectives per rank, steady step (rank 0)"))
    return None


def _is_preset(cfg: TrainConfig) -> bool:
    from ndparallel.models.presets import is_preset

    return is_preset(cfg.base_model)


def _global_numel(model) -> int:
    from torch.distributed.tensor import DTensor

    seen, n = set(), 0
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            n += p.numel() if not isinstance(p, DTensor) else p.shape.numel()
    return n


def _plot_curves(out: Path) -> None:
    """The loss / throughput PNG next to metrics.jsonl (skipped without matplotlib)."""
    try:
        from ndparallel.plot import plot_run

        print(f"loss curve: {plot_run(out)}")
    except ImportError:
        print("loss curve: skipped (pip install matplotlib, then `ndparallel plot` the run)")


def _local_numel(model) -> int:
    from torch.distributed.tensor import DTensor

    return sum((p.to_local() if isinstance(p, DTensor) else p).numel()
               for p in {id(p): p for p in model.parameters()}.values())


def _dump_yaml(cfg: TrainConfig) -> str:
    import yaml

    return yaml.safe_dump(cfg.model_dump(mode="json", exclude_none=True), sort_keys=False)


class _Progress:
    """A rich progress bar with the latest loss, lr and throughput (main rank only)."""

    def __init__(self, total: int, start: int, enabled: bool):
        self.enabled = enabled
        if not enabled:
            return
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        self.interactive = Console().is_terminal
        if not self.interactive:  # logs / CI: plain lines only
            return
        self.bar = Progress(
            TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
            TextColumn("{task.fields[info]}"),
        )
        self.bar.start()
        self.task = self.bar.add_task("train", total=total, completed=start, info="")

    def update(self, step: int, m: dict) -> None:
        if not self.enabled:
            return
        info = (f"loss {m['loss']:.4f} | lr {m['lr']:.2e} | gnorm {m['grad_norm']:.3f} | "
                f"{m['tokens_per_s']:.0f} tok/s | {m['tflops_per_device']:.3f} TFLOP/s/dev"
                + (f" | MFU {m['mfu']:.1%}" if "mfu" in m else "")
                + f" | mem {m['peak_memory_gb']:.2f} GB")
        if self.interactive:
            self.bar.update(self.task, completed=step, info=info)
        else:
            print(f"step {step}: {info}", flush=True)

    def close(self) -> None:
        if self.enabled and self.interactive:
            self.bar.stop()
