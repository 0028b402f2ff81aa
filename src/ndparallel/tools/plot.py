"""``ndparallel plot RUN_DIR``: loss and throughput curves from ``metrics.jsonl`` to a PNG."""

from __future__ import annotations

import json
from pathlib import Path

from ndparallel.runtime.extras import require


def read_metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: pass the output_dir of a training run")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def plot_run(run_dir: Path, out: Path | None = None) -> Path:
    """The PNG of ``run_dir``'s curves (``out``, default ``run_dir/metrics.png``); ``MissingExtra``
    without matplotlib."""
    require("plot", "the loss curve")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(run_dir)
    train = [r for r in rows if "loss" in r]
    evals = [r for r in rows if "eval_loss" in r]
    if not train:
        raise ValueError(f"{run_dir / 'metrics.jsonl'} holds no training steps")
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    ax1.plot([r["step"] for r in train], [r["loss"] for r in train], label="train loss")
    if evals:
        ax1.plot([r["step"] for r in evals], [r["eval_loss"] for r in evals], "o-", label="eval loss")
    ax1.set_xlabel("step")
    ax1.set_ylabel("loss")
    ax1.legend()
    ax1.grid(alpha=0.3)
    ax2.plot([r["step"] for r in train], [r["tokens_per_s"] for r in train], color="tab:green")
    ax2.set_xlabel("step")
    ax2.set_ylabel("tokens/s (global)")
    ax2.grid(alpha=0.3)
    fig.suptitle(str(run_dir))
    fig.tight_layout()
    out = out or run_dir / "metrics.png"
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
