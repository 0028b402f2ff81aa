"""Planner validation on CPU: predicted vs measured peak memory per rank and step-time ranking.

    python bench/plan_validation.py [--seq 256] [--mb 2] [--steps 3] [--no-calibrate]
    python bench/plan_validation.py --gpu-results [FILE] [--hardware-file PROFILE]

Runs the tiny Llama (the planner's ``tiny`` spec) in fp32 with AdamW under several layouts on
forked gloo CPU ranks and writes ``bench/results/plan_validation.json``.

*Measured* memory is the quantity ``estimate_memory`` predicts minus its ``overhead`` field:
the bytes of tensor storage alive on rank 0 at the peak of one steady-state step (forward, backward
and the optimizer step),
= states present before the step (local parameter shards, their gradients kept allocated by
``zero_grad(set_to_none=False)``, AdamW states; unique storages, FSDP padding included) + the
peak of storages created during the step (``runtime/memory_probe.py``: ``LiveBytes``). Allocator
caching/fragmentation, the Python/torch runtime and gloo buffers are not counted (the planner's
``overhead``). The optimizer step is in the window: unfused AdamW's temporaries are the planner's
optimizer-step moment.
*Predicted*: ``estimate_memory(...).total - overhead`` with mixed_precision fp32.
Step time: median of ``--steps`` steps after a warm-up, vs ``search.estimate(...).time.step`` with
hardware calibrated here (``ndparallel.plan.calibrate.measure``, quick), gpus_per_node = 4.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from datetime import date
from pathlib import Path

import torch
import transformers  # noqa: F401  (imported once before forking ranks)

from ndparallel.runtime.memory_probe import LiveBytes, state_bytes

LAYOUTS = {  # name: (ParallelismConfig kwargs, world)
    "1": ({}, 1),
    "DP2": ({"dp_replicate_size": 2}, 2),
    "FSDP2": ({"dp_shard_size": 2}, 2),
    "FSDP4": ({"dp_shard_size": 4}, 4),
    "TP2": ({"tp_size": 2}, 2),
    "FSDP2xTP2": ({"dp_shard_size": 2, "tp_size": 2}, 4),
    "CP2": ({"cp_size": 2}, 2),
    "FSDP2xCP2": ({"dp_shard_size": 2, "cp_size": 2}, 4),
}
GOAL = 0.10


def _rank(layout: dict, seq: int, mb: int, steps: int, tp: dict):
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from ndparallel import Accelerator, ParallelismConfig
    from ndparallel.engine import forward_backward
    from ndparallel.models.presets import preset_config
    from ndparallel.parallel.options import TPOptions

    acc = Accelerator(ParallelismConfig(**layout), mixed_precision="no", tp_options=TPOptions(**tp))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(preset_config("tiny-llama"))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = acc.prepare(model, opt)
    model.train()
    g = torch.Generator().manual_seed(acc.dp_rank)
    times, mem = [], None
    for i in range(steps + 2):
        tokens = torch.randint(0, 256, (mb, seq + 1), generator=g)
        ids, labels = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
        pos = torch.arange(seq).expand(mb, -1).clone()
        dist.barrier()
        t0 = time.perf_counter()
        tracker = LiveBytes() if i == 1 else None
        states = state_bytes(model, opt) if tracker else None
        with tracker or _null():  # the whole step: the optimizer's temporaries count too
            forward_backward(
                acc.engine, model, [{"input_ids": ids, "shift_labels": labels, "position_ids": pos}]
            )
            opt.step()
        opt.zero_grad(set_to_none=False)
        dist.barrier()
        if tracker:
            mem = {**states, "transient_peak": tracker.peak, "total": sum(states.values()) + tracker.peak}
        elif i >= 2:
            times.append(time.perf_counter() - t0)
    return {"memory": mem, "step_s": statistics.median(times)}


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--mb", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument(
        "--no-calibrate",
        action="store_true",
        help="cost step times with a fixed CPU profile instead of measuring one",
    )
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "plan_validation.json"))
    ap.add_argument(
        "--gpu-results",
        nargs="?",
        const=str(REFERENCE / "h200_plan_gpu_check.json"),
        help="instead of the CPU runs: compare the planner with a bench/plan_gpu_check.py "
        "JSON (default: the H200 reference)",
    )
    ap.add_argument("--hardware-file", help="with --gpu-results: cost with this profile, not the preset")
    args = ap.parse_args(argv)
    if args.gpu_results:
        return gpu_table(args.gpu_results, args.hardware_file)

    from ndparallel.layout.dims import ParallelDims
    from ndparallel.plan.hardware import Hardware
    from ndparallel.plan.memory.peak import estimate_memory
    from ndparallel.plan.models import PRESETS
    from ndparallel.plan.search.evaluation import estimate
    from ndparallel.plan.settings import Settings
    from ndparallel.testing import run_on_ranks

    if args.no_calibrate:
        hw = Hardware("cpu-assumed", 8e9, 2e10, 2e10, 5e9, 1e9, 1e9, 5e-5, 5e-5, 1.0, 1.0, 0.25e9)
    else:
        from ndparallel.plan.calibrate.measure import calibrate

        hw = Hardware.from_dict(calibrate(ranks=4, quick=True, device="cpu")["hardware"])
    model = PRESETS["tiny"]
    rows = []
    for name, (kw, world) in LAYOUTS.items():
        lay = ParallelDims(
            kw.get("dp_replicate_size", 1),
            kw.get("dp_shard_size", 1),
            kw.get("cp_size", 1),
            kw.get("tp_size", 1),
        )
        tp = {"sequence_parallel": True, "loss_parallel": True} if lay.tp > 1 else {}
        # The runs below keep gradients allocated (zero_grad(set_to_none=False)).
        s = Settings(
            sequence_len=args.seq,
            micro_batch_size=args.mb,
            mixed_precision="fp32",
            sequence_parallel=lay.tp > 1,
            loss_parallel=lay.tp > 1,
            set_to_none=False,
            chunked_loss=True,
        )  # the runtime's default loss (forward_backward)
        m = estimate_memory(model, lay, s, hw)
        predicted = m.total - m.overhead
        est = estimate(model, lay, s, hw, gpus_per_node=4, global_batch=args.mb * lay.dp)
        res = run_on_ranks(_rank, world, kw, args.seq, args.mb, args.steps, tp, timeout_s=600)
        meas = res[0]["memory"]
        step = max(r["step_s"] for r in res)
        err = (predicted - meas["total"]) / meas["total"]
        rows.append(
            {
                "layout": name,
                "degrees": lay.compact(),
                "world": world,
                "predicted_bytes": predicted,
                "measured_bytes": meas["total"],
                "error": err,
                "within_goal": abs(err) <= GOAL,
                "peak_phase": m.peak_phase,
                "predicted_parts": {
                    k: getattr(m, k)
                    for k in ("params", "grads", "optimizer", "activations", "logits", "fsdp_buffers")
                },
                "measured_parts": meas,
                "predicted_step_s": est.time.step,
                "measured_step_s": step,
            }
        )
        print(
            f"  {name}: predicted {predicted / 2**20:.2f} MiB, measured "
            f"{meas['total'] / 2**20:.2f} MiB ({err:+.1%}); step {step * 1e3:.0f} ms",
            file=sys.stderr,
            flush=True,
        )
    rank_p = _ranks([r["predicted_step_s"] for r in rows])
    rank_m = _ranks([r["measured_step_s"] for r in rows])
    n = len(rows)
    spearman = 1 - 6 * sum((a - b) ** 2 for a, b in zip(rank_p, rank_m)) / (n * (n * n - 1))
    for r, a, b in zip(rows, rank_p, rank_m):
        r["predicted_rank"], r["measured_rank"] = a, b
    _print(rows, spearman)
    out = {
        "date": date.today().isoformat(),
        "machine": platform.node(),
        "cpu_count": __import__("os").cpu_count(),
        "torch": torch.__version__,
        "seq_len": args.seq,
        "micro_batch": args.mb,
        "precision": "fp32",
        "goal": GOAL,
        "hardware": hw.name,
        "spearman_step_time": spearman,
        "rows": rows,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(f"wrote {args.out}")
    return 0


REFERENCE = Path(__file__).parent / "reference"


def gpu_table(path: str, hardware_file: str | None) -> int:
    """Predicted vs measured for every row of a plan_gpu_check.py JSON (one GPU, layout 1x1x1x1)."""
    from rich.console import Console
    from rich.table import Table

    from ndparallel.layout.dims import ParallelDims
    from ndparallel.plan.hardware import PRESETS as HW
    from ndparallel.plan.hardware import load_hardware_file, preset_for_device
    from ndparallel.plan.models import PRESETS
    from ndparallel.plan.search.evaluation import estimate
    from ndparallel.plan.settings import Settings

    data = json.loads(Path(path).read_text())
    hw = (
        load_hardware_file(hardware_file)
        if hardware_file
        else preset_for_device(data.get("device", "")) or HW["h200"]
    )
    t = Table(title=f"planner ({hw.name}) vs {data.get('device')}: peak allocated, tokens/s")
    for c in ("config", "pred GiB", "meas GiB", "err", "pred tok/s", "meas tok/s", "err", "reserved GiB"):
        t.add_column(c, justify="left" if c == "config" else "right")
    worst_mem = worst_tps = 0.0
    for r in data["rows"]:
        if "error" in r:
            continue
        s = Settings(
            sequence_len=r["seq"],
            micro_batch_size=r["micro_batch"],
            activation_checkpointing=r["checkpointing"],
            optimizer_fused=r["fused_adamw"],
        )
        e = estimate(PRESETS[r["planner_model"]], ParallelDims(), s, hw, 8)
        mem = e.memory.allocated / 2**30
        tps = r["micro_batch"] * r["seq"] / e.time.step
        em, et = mem / r["max_allocated_gib"] - 1, tps / r["tokens_per_s"] - 1
        worst_mem, worst_tps = max(worst_mem, abs(em)), max(worst_tps, abs(et))
        t.add_row(
            r["config"],
            f"{mem:.2f}",
            f"{r['max_allocated_gib']:.2f}",
            f"{em:+.1%}",
            f"{tps:,.0f}",
            f"{r['tokens_per_s']:,.0f}",
            f"{et:+.1%}",
            f"{r['max_reserved_gib']:.1f}",
        )
    Console(width=140).print(t)
    print(f"worst |error|: memory {worst_mem:.1%} (goal 10 %), tokens/s {worst_tps:.1%} (goal 15 %)")
    return 0 if worst_mem <= 0.10 and worst_tps <= 0.15 else 1


def _ranks(values):
    order = sorted(range(len(values)), key=lambda i: values[i])
    ranks = [0] * len(values)
    for r, i in enumerate(order, 1):
        ranks[i] = r
    return ranks


def _print(rows, spearman):
    from rich.console import Console
    from rich.table import Table

    t = Table(title="planner vs CPU run: peak memory per rank (fp32, AdamW), step time")
    for c in (
        "layout",
        "pred MiB",
        "meas MiB",
        "error",
        "≤10%",
        "pred step ms",
        "meas step ms",
        "rank pred/meas",
    ):
        t.add_column(c, justify="left" if c == "layout" else "right")
    for r in rows:
        t.add_row(
            r["layout"],
            f"{r['predicted_bytes'] / 2**20:.2f}",
            f"{r['measured_bytes'] / 2**20:.2f}",
            f"{r['error']:+.1%}",
            "yes" if r["within_goal"] else "NO",
            f"{r['predicted_step_s'] * 1e3:.1f}",
            f"{r['measured_step_s'] * 1e3:.1f}",
            f"{r['predicted_rank']}/{r['measured_rank']}",
        )
    Console(width=120).print(t)
    print(f"step-time ranking, Spearman rho = {spearman:.2f}")


if __name__ == "__main__":
    raise SystemExit(main())
