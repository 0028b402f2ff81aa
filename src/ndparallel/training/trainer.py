"""The loop behind ``ndparallel train``: runs on every rank of an already started job.

``run_training`` = ``Trainer(cfg).run()``; the phases are methods, in the order they run:
``setup`` (accelerator, data, model, optimizer, schedule) → ``resume`` → per step ``train_step``,
``log``, ``maybe_evaluate``, ``maybe_save`` → ``finish`` (the final model).
"""

from __future__ import annotations

import gc
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ndparallel.checkpoint import (
    AsyncCheckpointer,
    checkpoint_dir,
    find_resume_checkpoint,
    load_checkpoint,
    save_step_checkpoint,
)
from ndparallel.checkpoint.export import save_hf_model
from ndparallel.config import TrainConfig
from ndparallel.engine import Engine, batch_to_device, train_step
from ndparallel.engine.nonfinite import NonFiniteGuard
from ndparallel.models.attention import attention_kernel
from ndparallel.models.presets import is_preset
from ndparallel.optim.build import build_scheduler
from ndparallel.runtime.distributed import rank0_decides, shutdown
from ndparallel.runtime.preemption import PreemptionWatch
from ndparallel.training.components import (
    build_data,
    data_cache_dir,
    grown_vocab_size,
    load_tokenizer,
    model_config,
    optimizer_for,
    rounded_vocab,
    row_widths,
    train_loader,
)
from ndparallel.training.controls import EarlyStopping, LossWatchdog, eval_every, freeze_except
from ndparallel.training.evaluate import evaluate, validation_loader
from ndparallel.training.metrics import peak_memory_gb
from ndparallel.training.outputs import claim_output_dir
from ndparallel.training.progress import Progress
from ndparallel.training.run_start import (
    profile_step,
    quiet_non_main_ranks,
    resume_policy,
    start_outputs,
)
from ndparallel.training.stopping import Interrupted, stop_for_preemption

if TYPE_CHECKING:  # annotations only
    from ndparallel.data.loader import PackedLoader
    from ndparallel.data.packing import PackedSplits
    from ndparallel.data.stream import StreamingLoader
    from ndparallel.engine.loss_scale import LossScaler
    from ndparallel.runtime.comm_profile import CommProfiler
    from ndparallel.tracking.run import RunTrackers


@dataclass
class TrainState:
    step: int = 0
    samples_seen: int = 0  # global samples consumed: resumes on any layout


class Trainer:
    """One training run per ``cfg`` on the current process group."""

    def __init__(self, cfg: TrainConfig, profile_comm: bool = False):
        self.cfg = cfg
        self.profile_comm = profile_comm
        self.out = Path(cfg.output_dir)
        self.state = TrainState()
        self.last: dict = {}
        """The last logged metrics."""
        # built by ``setup``, in its order
        self.engine: Engine | None = None
        self.tokenizer = None
        self.splits: PackedSplits | None = None
        self.loader: PackedLoader | StreamingLoader | None = None
        self.val_loader = None
        self.eval_every: int | None = None
        self.total_steps = 0
        self.save_every: int | None = None
        self.hf_config = None
        """The model's transformers config (``_load_model``)."""
        self.model: torch.nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.scheduler = None
        self.nonfinite: NonFiniteGuard | None = None
        self.scaler: LossScaler | None = None
        self.watchdog: LossWatchdog | None = None
        self.early_stopping: EarlyStopping | None = None
        self.stopped = False
        self.checkpointer: AsyncCheckpointer | None = None
        self._saved_step: int | None = None
        # set when the steps start (``run``, ``start_outputs``)
        self.metrics: RunTrackers | None = None
        self.flops_per_token = 0.0
        self.peak_flops: float | None = None
        self.profiler: CommProfiler | None = None
        self.progress: Progress | None = None
        self.preemption: PreemptionWatch | None = None
        self._log_time, self._log_step = 0.0, 0

    # ----------------------------------------------------------------------------- phases
    def setup(self) -> None:
        """Engine (process group, layout, mesh, strategies), tokenizer, data, model, optimizer and
        schedule."""

        cfg = self.cfg
        self.engine = engine = Engine(
            cfg.parallelism_config(),
            cfg.strategy_options(),
            device=None if cfg.device == "auto" else cfg.device,
            timeout_s=cfg.collective_timeout_s,
        )
        quiet_non_main_ranks(engine.rank)
        if cfg.tf32 and engine.device.type == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = True
            torch.backends.cudnn.allow_tf32 = True
        cache_dir = data_cache_dir(cfg)
        torch.manual_seed(cfg.seed)
        self.tokenizer = load_tokenizer(cfg, cache_dir)
        self.splits = build_data(cfg, self.tokenizer, cache_dir)
        widths = row_widths(cfg, engine.dims)
        self.loader = train_loader(cfg, self.splits, self.tokenizer, engine.dp_rank, engine.dp_size, widths)
        self.val_loader = None
        if self.splits.val is not None:
            self.val_loader = validation_loader(
                engine, self.splits.val, cfg.micro_batch_size, cfg.seed, widths.multiple, widths.buckets
            )
        steps_per_epoch = len(self.loader) // cfg.gradient_accumulation_steps
        self.eval_every = eval_every(cfg.eval_steps, cfg.evals_per_epoch, steps_per_epoch)
        self.total_steps = (
            cfg.max_steps
            if cfg.max_steps is not None  # max_steps wins over num_epochs
            else max(1, math.floor(cfg.num_epochs * steps_per_epoch))
        )
        self.save_every = cfg.save_steps or (
            max(1, steps_per_epoch // cfg.saves_per_epoch) if cfg.saves_per_epoch else None
        )
        self.model = self._load_model()
        self.optimizer = optimizer_for(cfg, self.model)  # the model: low-bit AdamW finds its embeddings
        warmup = (
            cfg.warmup_steps if cfg.warmup_ratio is None else math.ceil(cfg.warmup_ratio * self.total_steps)
        )
        self.scheduler = build_scheduler(
            self.optimizer,
            cfg.lr_scheduler,
            warmup,
            self.total_steps,
            cfg.cosine_min_lr_ratio,
            cfg.cosine_constant_lr_ratio,
            cfg.lr_quadratic_warmup,
        )
        self.nonfinite = NonFiniteGuard(cfg.on_nonfinite)
        self.scaler = cfg.loss_scaler()  # fp16: dynamic loss scaling (None otherwise)
        self.watchdog = LossWatchdog(
            cfg.loss_watchdog_threshold, cfg.loss_watchdog_patience, cfg.loss_watchdog_action
        )
        self.early_stopping, self.stopped = EarlyStopping(cfg.early_stopping_patience), False
        self._saved_step: int | None = None
        self.checkpointer = None
        if cfg.checkpoint_async:
            self.checkpointer = AsyncCheckpointer(timeout_s=cfg.collective_timeout_s)

    def _load_model(self):
        """The model, sharded, with the attention kernel this machine has (one warning line if the
        requested one is missing) and no KV cache (with one, transformers would not mask packed samples)."""

        cfg, engine = self.cfg, self.engine
        kernel, why = attention_kernel(cfg.attn_implementation, engine.device.type)
        if why and not engine.dims.cp_enabled:
            engine.print(
                f"ndparallel train: warning: attn_implementation {cfg.attn_implementation} is not "
                f"available ({why}): using {kernel}"
            )  # one line, main rank
        self.hf_config = model_config(cfg, vocab_size=rounded_vocab(cfg, len(self.tokenizer)))
        text = self.hf_config.get_text_config()  # a multimodal checkpoint: its text model's fields
        self.hf_config.use_cache = text.use_cache = False
        source = self.hf_config if is_preset(cfg.base_model) or cfg.reinit_weights else cfg.base_model
        grown = None if is_preset(cfg.base_model) else grown_vocab_size(cfg, self.tokenizer, text.vocab_size)
        if grown:  # tokens added to the tokenizer: new embedding / LM-head rows
            engine.print(
                f"ndparallel train: the tokenizer has {len(self.tokenizer)} tokens, the model "
                f"{text.vocab_size} rows: growing to {grown} (new rows = the mean row)"
            )
            text.vocab_size = grown
        adapter = cfg.lora_config()  # LoRA: the frozen base is kept in the compute dtype (bf16/fp16 run)
        dtype = (cfg.compute_dtype() if adapter is not None else None) or torch.float32
        model = engine.build_model(
            source,
            seed=cfg.seed,
            trust_remote_code=cfg.trust_remote_code,
            adapter=adapter,
            adapter_weights=cfg.lora_model_dir or None,
            vocab_size=grown,
            dtype=dtype,
            attn_implementation=kernel,
            quantization=cfg.nf4_config(),
            config_overrides=cfg.overrides_of_model_config,
            revision=cfg.revision_of_model,
        )
        if getattr(model, "config", None) is not None:
            model.config.use_cache = False
        if cfg.unfrozen_parameters and adapter is None:
            freeze_except(model, cfg.unfrozen_parameters)  # before the first forward (FSDP2's lazy init)
        return model

    def resume(self) -> None:
        """Continue from a checkpoint (any layout: DCP reshards; data resumes by samples seen)."""

        resume = resume_policy(self.cfg.resume_from_checkpoint, os.environ)
        if not resume:
            return
        try:  # rank 0 chooses (and validates) once; every rank resumes from the same step
            ckpt = rank0_decides(find_resume_checkpoint, self.out, resume)
        except ValueError as e:
            raise ValueError(f"resume_from_checkpoint: {e}") from None
        if ckpt is None:
            return
        extra = load_checkpoint(ckpt, self.model, self.optimizer, self.scheduler)
        self.state = TrainState(step=int(extra["step"]), samples_seen=int(extra["samples_seen"]))
        if self.scaler is not None and "loss_scale" in extra:  # fp16: continue with the same scale
            self.scaler.load_state_dict(extra["loss_scale"])
        self.engine.print(f"resumed from {ckpt} at step {self.state.step}")

    def train_step(self) -> dict:
        """One optimizer step over ``gradient_accumulation_steps`` micro-batches (the engine's
        ``train_step``, which ``verify`` runs too). Nothing is read back from the device: the loss
        and grad norm come back as device tensors for ``log``."""
        cfg, engine = self.cfg, self.engine
        first = self.state.samples_seen // self.loader.global_micro_batch
        indices = range(first, first + cfg.gradient_accumulation_steps)
        micro_batches = [batch_to_device(self.loader.micro_batch(i), engine.device) for i in indices]
        real, computed = (sum(c) for c in zip(*(self.loader.token_counts(i) for i in indices)))
        out = train_step(
            engine,
            self.model,
            self.optimizer,
            micro_batches,
            scheduler=self.scheduler,
            max_grad_norm=cfg.max_grad_norm,
            guard=self.nonfinite,
            step=self.state.step + 1,
            scaler=self.scaler,
            loss_reduction=cfg.loss_reduction,
        )
        if self.profiler is not None:
            self.profiler = profile_step(engine, self.profiler, self.out)
        self.state.step += 1
        self.state.samples_seen += self.loader.global_micro_batch * cfg.gradient_accumulation_steps
        return {
            "loss": out.loss,
            "grad_norm": out.grad_norm,
            "lr": self.scheduler.get_last_lr()[0],
            "tokens": real,
            "computed_tokens": computed,
            "aux_loss": out.aux_loss,
        }

    def log(self, step_out: dict) -> dict | None:
        """On logging steps (every ``logging_steps``, the first and the last): read the loss and
        the grad norm (the only host syncs of training, with the non-finite check), write the
        metrics; throughput is measured over the steps since the last log, in real tokens (not
        padding: the loader counts them, ``token_counts``), the padded share beside it."""
        step, cfg, engine = self.state.step, self.cfg, self.engine
        tokens, computed = self._tokens_since_log
        self._tokens_since_log = (tokens + step_out["tokens"], computed + step_out["computed_tokens"])
        if step % cfg.logging_steps and step not in (1, self.total_steps):
            return None
        loss = step_out["loss"]  # already the global mean (reduced in train_step)
        metrics = {
            "step": step,
            "loss": float(loss),
            "lr": float(step_out["lr"]),  # a tensor under torchao
            "grad_norm": float(step_out["grad_norm"]),
        }
        if self.scaler is not None:  # fp16: the scale after this step and the overflow skips so far
            metrics.update(loss_scale=self.scaler.scale, overflow_skips=self.scaler.skipped)
        if step_out.get("aux_loss") is not None:  # an MoE model's load-balancing loss (in "loss")
            metrics["aux_loss"] = float(step_out["aux_loss"])
        now = time.perf_counter()
        elapsed, steps = now - self._log_time, max(1, step - self._log_step)
        self._log_time, self._log_step = now, step
        tokens, computed = self._tokens_since_log  # real (not padding) and computed, since the last log
        self._tokens_since_log = (0, 0)
        metrics.update(
            {
                "step_time_s": elapsed / steps,
                "tokens_per_s": tokens / elapsed,  # real tokens: padding is not throughput
                "tokens_per_s_per_device": tokens / elapsed / engine.world_size,
                "padding_fraction": 1.0 - tokens / computed if computed else 0.0,
                "tflops_per_device": self.flops_per_token * tokens / elapsed / engine.world_size / 1e12,
                "peak_memory_gb": peak_memory_gb(engine.device),
            }
        )
        if self.peak_flops:
            metrics["mfu"] = metrics["tflops_per_device"] * 1e12 / self.peak_flops
        self.metrics.write(metrics)
        self.progress.update(step, metrics)
        self.nonfinite.check()
        warning = self.watchdog.check(step, metrics["loss"])  # the same global loss on every rank
        if warning:
            self.stopped = True
            engine.print(f"ndparallel train: warning: {warning}")
        return metrics

    def maybe_evaluate(self) -> None:

        cfg, step = self.cfg, self.state.step
        if self.val_loader is None or (
            (not self.eval_every or step % self.eval_every) and step != self.total_steps
        ):
            return
        ev = evaluate(self.engine, self.model, self.val_loader)
        self.metrics.write({"step": step, **ev})
        self.engine.print(
            f"step {step}: eval_loss {ev['eval_loss']:.4f} perplexity {ev['eval_perplexity']:.2f}"
        )
        if self.early_stopping.should_stop(ev["eval_loss"]):
            self.stopped = True
            self.engine.print(
                f"step {step}: no lower eval_loss in {cfg.early_stopping_patience} evaluations: stopping"
            )

    def maybe_save(self) -> None:
        if self.save_every and self.state.step % self.save_every == 0:
            self.save_checkpoint(periodic=True)

    def save_checkpoint(self, periodic: bool = False) -> Path:
        """``checkpoint-{step}``: in the background with ``checkpoint_async`` (``periodic``), else
        now. Not twice for one step; a background save in flight is awaited first."""

        cfg, step = self.cfg, self.state.step
        if self.checkpointer is not None and not periodic:
            self.checkpointer.wait()
        if self._saved_step == step:
            return checkpoint_dir(cfg.output_dir, step)
        self.nonfinite.check()  # never a checkpoint of a diverged model
        background = self.checkpointer is not None and periodic
        save = self.checkpointer.save_step if background else save_step_checkpoint
        path = save(
            cfg.output_dir,
            step,
            self.model,
            self.optimizer,
            self.scheduler,
            config=cfg.model_dump(mode="json"),
            extra=self._checkpoint_extra(),
            save_total_limit=cfg.save_total_limit,
            layout=self.engine.dims,
        )
        self._saved_step = step
        self.engine.print(
            f"step {step}: checkpoint {'being written to' if background else 'saved to'} {path}"
        )
        return path

    def _checkpoint_extra(self) -> dict:
        extra = {"samples_seen": self.state.samples_seen}
        if self.scaler is not None:
            extra["loss_scale"] = self.scaler.state_dict()
        return extra

    def finish(self) -> None:
        """The final Hugging Face model; then leave the process group."""

        engine = self.engine
        if self.checkpointer is not None:
            self.checkpointer.close()  # the last checkpoint is complete before the run ends
        self.nonfinite.check()
        if self.cfg.save_final_model:
            # the optimizer states (2× the model in fp32 for AdamW) are not needed any more: free
            # them before gathering the full tensors
            self.optimizer.state.clear()
            gc.collect()
            if engine.device.type == "cuda":
                torch.cuda.empty_cache()
            final = self.out / "final"
            save_hf_model(
                self.model,
                final,
                engine.is_main_process,
                tokenizer=self.tokenizer,
                dtype=self.cfg.export_dtype(),
            )
            engine.barrier()
            if self.cfg.adapter is None:
                engine.print(
                    f"saved the trained model to {final} (AutoModelForCausalLM.from_pretrained loads it)"
                )
            else:
                engine.print(
                    f"saved the LoRA adapter to {final} (PeftModel.from_pretrained(base_model, "
                    f"{str(final)!r}) loads it"
                    + ("; trained on the 4-bit NF4 base)" if self.cfg.load_in_4bit else ")")
                )
            if self.cfg.adapter is not None and self.cfg.merge_lora:
                self._save_merged()
        self.metrics.finish()
        shutdown()

    def _save_merged(self) -> None:

        merged = self.out / "merged"
        save_hf_model(
            self.model,
            merged,
            self.engine.is_main_process,
            tokenizer=self.tokenizer,
            dtype=self.cfg.export_dtype(),
            merge_adapter=True,
        )
        self.engine.barrier()
        into = " into the dequantised NF4 base" if self.cfg.load_in_4bit else ""
        self.engine.print(
            f"saved the merged model{into} to {merged} (AutoModelForCausalLM.from_pretrained loads it)"
        )

    # ------------------------------------------------------------------------------- run
    def run(self) -> dict:
        """All phases; returns the last logged metrics (the last step is always logged). Ends with
        ``Preempted`` after a preemption signal, ``Interrupted`` after Ctrl-C."""

        self.setup()
        self.resume()

        resuming = resume_policy(self.cfg.resume_from_checkpoint, os.environ) is not None
        claim_output_dir(self.engine, self.cfg, resuming, self.profile_comm)  # before the first write
        self.metrics, self.flops_per_token, self.peak_flops, self.profiler = start_outputs(self)
        self.model.train()
        self.progress = Progress(self.total_steps, self.state.step, enabled=self.engine.is_main_process)
        self._log_time, self._log_step = time.perf_counter(), self.state.step
        self._tokens_since_log = (0, 0)
        self.preemption = PreemptionWatch(self.cfg.preemption_timeout_s, name="ndparallel train")
        try:
            with self.preemption:  # signals handled until the end (a final export completes)
                try:
                    while self.state.step < self.total_steps and not self.stopped:
                        self.last = self.log(self.train_step()) or self.last
                        self.maybe_evaluate()
                        self.maybe_save()
                        if self.preemption.should_stop():
                            raise stop_for_preemption(self)
                finally:
                    self.progress.close()
                self.preemption.settle()  # no agreement collective in flight from here on
                self.finish()
        except BaseException as exc:
            if isinstance(exc, KeyboardInterrupt) or self.preemption.interrupted:
                raise Interrupted(self.state.step) from None
            if self.preemption.requested and not self.preemption.stopping:
                self.preemption.die_of_signal()  # stopped by the launcher as a peer failed: no traceback
            raise
        return self.last


def run_training(cfg: TrainConfig, profile_comm: bool = False) -> dict:
    """Train per ``cfg`` on the current process group; returns the final metrics (main rank)."""
    return Trainer(cfg, profile_comm=profile_comm).run()
