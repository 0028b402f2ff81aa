"""Progress output of ``ndparallel train`` (main rank only): a rich bar on a terminal, plain lines
in logs and CI."""

from __future__ import annotations


def format_metrics(m: dict) -> str:
    """One line: loss, lr, gradient norm, (fp16) the loss scale, throughput in real tokens (the
    padded share of the computed tokens beside it), MFU (when known), peak memory."""
    return (
        f"loss {m['loss']:.4f}"
        + (f" (aux {m['aux_loss']:.4f})" if "aux_loss" in m else "")
        + f" | lr {m['lr']:.2e} | gnorm {m['grad_norm']:.3f} | "
        + (
            f"scale {m['loss_scale']:g} ({m['overflow_skips']} overflow skips) | "
            if "loss_scale" in m
            else ""
        )
        + f"{m['tokens_per_s']:.0f} tok/s"
        + (f" ({m['padding_fraction']:.0%} padding)" if m.get("padding_fraction", 0) >= 0.005 else "")
        + f" | {m['tflops_per_device']:.3f} TFLOP/s/dev"
        + (f" | MFU {m['mfu']:.1%}" if "mfu" in m else "")
        + f" | mem {m['peak_memory_gb']:.2f} GB"
    )


class Progress:
    """A progress bar with the latest metrics (interactive), else one printed line per update."""

    def __init__(self, total: int, start: int, enabled: bool):
        self.enabled = enabled
        self.interactive = False
        if not enabled:
            return
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            TextColumn,
            TimeRemainingColumn,
        )
        from rich.progress import Progress as Bar

        self.interactive = Console().is_terminal
        if not self.interactive:
            return
        self.bar = Bar(
            TextColumn("[bold]train"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeRemainingColumn(),
            TextColumn("{task.fields[info]}"),
        )
        self.bar.start()
        self.task = self.bar.add_task("train", total=total, completed=start, info="")

    def update(self, step: int, metrics: dict) -> None:
        if not self.enabled:
            return
        info = format_metrics(metrics)
        if self.interactive:
            self.bar.update(self.task, completed=step, info=info)
        else:
            print(f"step {step}: {info}", flush=True)

    def close(self) -> None:
        if self.interactive:
            self.bar.stop()
