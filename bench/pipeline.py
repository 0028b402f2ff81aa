"""Pipeline parallel: each stage's idle (bubble) fraction against the schedule's formula, and its
peak step memory, on CPU gloo ranks; or, on one device, stage 0's and the last stage's compute.

    python bench/pipeline.py                # 5 schedules x pp 2, 4 x 4/8/16 micro-batches, ~3 min on 2 cores
    python bench/pipeline.py --quick        # pp 2, 4 micro-batches, GPipe / 1F1B / Interleaved1F1B, tiny
    model
    python bench/pipeline.py --one-rank-stage --device cuda   # one GPU (bench/gpu_all.sh, step
    pipeline_stages)
    python bench/pipeline.py --one-rank-stage --tiny          # its CPU form

Multi-rank mode: one forked gloo rank per stage (1 thread each), an untied Llama (default hidden
256, 8 layers, seq 128, vocab 512, fp32) cut by the engine (``Engine.parallelize``), one row per
micro-batch; each step is the engine's ``forward_backward`` (the schedule's forwards, backwards,
P2P), no optimizer. *Busy* = wall time inside the stage's ``forward_one_chunk`` /
``backward_one_chunk`` / ``backward_weight_one_chunk`` (wrapped on the ``PipelineStage`` objects;
the schedules wait for their receives outside them), summed over the rank's stages; *idle* =
1 − busy / makespan, the makespan being the slowest rank's step time from a common barrier; of the
timed steps the one with the smallest makespan is kept. *Formula*: (p−1)/(m+p−1) for GPipe / 1F1B,
(p−1)/(v·m+p−1) for the interleaved schedules (v stages per rank; for the zero-bubble ones an
upper bound: they fill part of it with weight-gradient passes). *Peak* = the largest sum of tensor
storages created during one more step and alive at once (``runtime.memory_probe.LiveBytes``: what
``torch.cuda.max_memory_allocated`` adds over a step on a GPU), gradients already allocated before
it: in-flight micro-batches' activations, P2P buffers, transients. With pp 4 the 4 ranks share 2
cores: when all stages compute they run at half speed, so the ramp phases are relatively faster
and idle reads below what 4 free cores would show (the ``cores`` field of the JSON).

One-rank mode (``--one-rank-stage``): one process (a one-rank world); stage 0 (embeddings + the
first half of the layers) and the last stage (the rest + norm + head + the engine's loss) cut with
``pipeline_stages.cut_stage`` and run as ``pipeline.StageModule`` on ``--device``: per micro-batch
forward and backward time, and the peak memory with 1 and ``--inflight`` micro-batches' activations
kept (CUDA: the allocator's peak; CPU: ``LiveBytes``). Prints ``HEADLINE:``; exit 0 when every
figure is finite and more in-flight micro-batches take more memory, else 1.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import transformers  # noqa: E402,F401  (imported once before the ranks fork)
from _common import RESULTS_ENV, print_table, write_json  # noqa: E402

SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble")
INTERLEAVED = ("Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble")
BUSY_METHODS = ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk")
MiB = 2**20


def model_config(hidden: int, layers: int, vocab: int):
    from transformers import LlamaConfig

    wide = hidden >= 1024  # Llama-3.2-1B's heads at its width: 32 of 64, 8 K/V
    heads = max(1, hidden // (64 if wide else 32))
    return LlamaConfig(
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // (4 if wide else 2)),
        vocab_size=vocab,
        max_position_embeddings=8192,
        tie_word_embeddings=False,
    )


def formula(schedule: str, p: int, m: int, v: int) -> float:
    """The textbook bubble fraction of a stage."""
    return (p - 1) / (v * m + p - 1) if schedule in INTERLEAVED else (p - 1) / (m + p - 1)


def micro_batches(m: int, seq: int, vocab: int, seed: int = 1) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        {
            "input_ids": torch.randint(0, vocab, (1, seq), generator=g),
            "shift_labels": torch.randint(0, vocab, (1, seq), generator=g),
            "position_ids": torch.arange(seq)[None],
        }
        for _ in range(m)
    ]


class BusyClock:
    """Wall seconds spent inside the compute methods of a rank's ``PipelineStage`` objects."""

    def __init__(self, stages) -> None:
        self.seconds = 0.0
        for stage in stages:
            for name in BUSY_METHODS:
                if hasattr(stage, name):
                    setattr(stage, name, self._timed(getattr(stage, name)))

    def _timed(self, fn):
        def wrapped(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t0

        return wrapped


def _timed_step(engine, model, mbs, clock) -> tuple[float, float]:
    """(makespan over the pp ranks, this rank's busy seconds) of one forward_backward."""
    import torch.distributed as dist

    from ndparallel.engine import forward_backward

    dist.barrier()
    clock.seconds = 0.0
    t0 = time.perf_counter()
    forward_backward(engine, model, mbs)
    took = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    dist.all_reduce(took, op=dist.ReduceOp.MAX)
    return float(took), clock.seconds


def _peak_bytes(engine, model, mbs) -> int:
    from ndparallel.engine import forward_backward
    from ndparallel.runtime.memory_probe import LiveBytes

    live = LiveBytes()
    with live:
        forward_backward(engine, model, mbs)
    return live.peak


def rank_run(args: dict) -> list[dict]:
    """On each rank of a pp world: every schedule, every micro-batch count; this rank's rows."""
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from ndparallel import ParallelismConfig
    from ndparallel.engine import Engine
    from ndparallel.parallel.options import PipelineOptions, StrategyOptions

    torch.set_num_threads(1)
    p, rows = dist.get_world_size(), []
    cfg = model_config(args["hidden"], args["layers"], args["vocab"])
    for schedule in args["schedules"]:
        torch.manual_seed(0)
        engine = Engine(
            ParallelismConfig(pp_size=p), StrategyOptions(pipeline=PipelineOptions(schedule=schedule))
        )
        model = engine.parallelize(AutoModelForCausalLM.from_config(cfg))
        pipeline = engine.pipeline_of(model)
        clock = BusyClock(pipeline.stages)
        params = sum(t.numel() * t.element_size() for t in model.parameters())
        for m in args["microbatches"]:
            mbs = micro_batches(m, args["seq"], args["vocab"])
            _timed_step(engine, model, mbs, clock)  # a new micro-batch count: the schedule's set-up
            timed = [_timed_step(engine, model, mbs, clock) for _ in range(args["steps"])]
            makespan, busy = min(timed)
            rows.append(
                {
                    "schedule": schedule,
                    "pp": p,
                    "virtual": pipeline.plan.virtual,
                    "microbatches": m,
                    "rank": dist.get_rank(),
                    "stages": [int(s) for s in sorted(pipeline.modules)],
                    "formula": formula(schedule, p, m, pipeline.plan.virtual),
                    "makespan_s": makespan,
                    "busy_s": busy,
                    "idle": max(0.0, 1.0 - busy / makespan),
                    "makespans_s": [t for t, _ in timed],
                    "peak_mib": _peak_bytes(engine, model, mbs) / MiB,
                    "param_mib": params / MiB,
                }
            )
        del model, pipeline, engine
    return rows


def run_multi_rank(args) -> dict:
    from ndparallel.testing import run_on_ranks

    shared = {
        k: getattr(args, k)
        for k in ("hidden", "layers", "vocab", "seq", "steps", "schedules", "microbatches")
    }
    rows, load = [], [os.getloadavg()[0]]
    for p in args.pp:
        t0 = time.perf_counter()
        ranks = run_on_ranks(rank_run, p, shared, timeout_s=args.timeout)
        rows += [r for rank_rows in ranks for r in rank_rows]
        print(f"pp {p}: {time.perf_counter() - t0:.0f} s", flush=True)
    table = summarise(rows)
    load.append(os.getloadavg()[0])
    print_table(
        f"pipeline bubble: idle fraction per stage (measured) vs formula; {os.cpu_count()} cores, "
        f"load average {load[0]:.1f} -> {load[1]:.1f}",
        ["schedule", "pp", "m", "formula", "idle per stage", "mean idle", "step s", "peak MiB per stage"],
        [
            [
                r[k]
                for k in (
                    "schedule",
                    "pp",
                    "microbatches",
                    "formula",
                    "idle_text",
                    "mean_idle",
                    "makespan_s",
                    "peak_text",
                )
            ]
            for r in table
        ],
    )
    return {
        "rows": rows,
        "table": table,
        "cores": os.cpu_count(),
        "load_average": load,
        "oversubscribed": [p for p in args.pp if p > (os.cpu_count() or 1)],
    }


def summarise(rows: list[dict]) -> list[dict]:
    """One entry per (schedule, pp, m): the stages' idle fractions and peaks in rank order."""
    out, keyed = [], {}
    for r in rows:
        keyed.setdefault((r["schedule"], r["pp"], r["microbatches"]), []).append(r)
    for (schedule, p, m), group in keyed.items():
        group.sort(key=lambda r: r["rank"])
        idle = [r["idle"] for r in group]
        out.append(
            {
                "schedule": schedule,
                "pp": p,
                "microbatches": m,
                "formula": group[0]["formula"],
                "idle": idle,
                "mean_idle": statistics.fmean(idle),
                "makespan_s": group[0]["makespan_s"],
                "peak_mib": [r["peak_mib"] for r in group],
                "idle_text": " / ".join(f"{x:.2f}" for x in idle),
                "peak_text": " / ".join(f"{r['peak_mib']:.1f}" for r in group),
            }
        )
    return out


# ----------------------------------------------------------------------------- one rank, one device
def _stage_inputs(stage, mbs, hidden: int, device, dtype):
    if stage.is_first:
        return [mb["input_ids"].to(device) for mb in mbs]
    g = torch.Generator().manual_seed(2)
    return [
        torch.randn(*mb["input_ids"].shape, hidden, generator=g).to(device, dtype).requires_grad_()
        for mb in mbs
    ]


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _run_inflight(stage, inputs, mbs, device) -> tuple[list[float], list[float]]:
    """Forward every micro-batch keeping its graph, then backward each: (forward s, backward s)."""
    fwd, bwd, outs = [], [], []
    for x, mb in zip(inputs, mbs):
        _sync(device)
        t0 = time.perf_counter()
        outs.append(stage(x, mb["position_ids"].to(device), mb["shift_labels"].to(device)))
        _sync(device)
        fwd.append(time.perf_counter() - t0)
    for out in outs:
        grad = None if stage.is_last else torch.ones_like(out)
        _sync(device)
        t0 = time.perf_counter()
        out.backward(grad)
        _sync(device)
        bwd.append(time.perf_counter() - t0)
    return fwd, bwd


def _stage_peak(stage, inputs, mbs, device) -> int:
    """Peak bytes a run of ``inputs`` adds (CUDA: the allocator's; CPU: ``LiveBytes``)."""
    from ndparallel.runtime.memory_probe import LiveBytes

    if device.type == "cuda":
        _sync(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        _run_inflight(stage, inputs, mbs, device)
        return torch.cuda.max_memory_allocated(device) - base
    live = LiveBytes()
    with live:  # slows every op: the times come from untracked runs
        _run_inflight(stage, inputs, mbs, device)
    return live.peak


def one_rank_stages(args) -> dict:
    """Stage 0 and the last stage of a ``--stages``-stage cut on one device: times and memory."""
    import copy

    from transformers import AutoModelForCausalLM

    from ndparallel import ParallelismConfig
    from ndparallel.engine import Engine
    from ndparallel.parallel.pp.schedule import StageModule
    from ndparallel.parallel.pp.stages import cut_stage

    engine = Engine(ParallelismConfig(), device=args.device)
    device = engine.device
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    cfg = model_config(args.hidden, args.layers, args.vocab)
    torch.manual_seed(0)
    with torch.device(device):
        whole = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    per = args.layers // args.stages
    pieces = {
        0: cut_stage(copy.deepcopy(whole), range(per), first=True, last=False),
        args.stages - 1: cut_stage(whole, range(args.layers - per, args.layers), first=False, last=True),
    }
    mbs = micro_batches(args.inflight, args.seq, args.vocab)
    rows = []
    for index, lm in pieces.items():
        stage = StageModule(lm.train(), index, args.stages, engine.stage_loss)
        stage.num_items = torch.tensor(args.inflight * args.seq, device=device)
        inputs = _stage_inputs(stage, mbs, args.hidden, device, dtype)
        _run_inflight(stage, inputs[:1], mbs[:1], device)  # warm-up (kernels, allocator)
        fwd, bwd = _run_inflight(stage, inputs, mbs, device)
        one, many = (_stage_peak(stage, inputs[:k], mbs[:k], device) for k in (1, args.inflight))
        lm.zero_grad(set_to_none=True)
        rows.append(
            {
                "stage": index,
                "layers": per,
                "params": sum(p.numel() for p in lm.parameters()),
                "forward_ms": 1e3 * statistics.median(fwd),
                "backward_ms": 1e3 * statistics.median(bwd),
                "peak_1_mib": one / MiB,
                f"peak_{args.inflight}_mib": many / MiB,
                "per_microbatch_mib": (many - one) / MiB / max(1, args.inflight - 1),
            }
        )
    print_table(
        f"one pipeline stage on {device.type} ({args.dtype or dtype}; {args.stages} stages of {args.layers} "
        f"layers, seq {args.seq})",
        [
            "stage",
            "params",
            "fwd ms",
            "bwd ms",
            "peak 1 mb MiB",
            f"peak {args.inflight} mb MiB",
            "MiB / in-flight mb",
        ],
        [
            [
                r["stage"],
                r["params"],
                r["forward_ms"],
                r["backward_ms"],
                r["peak_1_mib"],
                r[f"peak_{args.inflight}_mib"],
                r["per_microbatch_mib"],
            ]
            for r in rows
        ],
    )
    return {"device": device.type, "dtype": str(dtype), "rows": rows}


def headline_one_rank(result: dict, inflight: int) -> tuple[str, bool]:
    parts, ok = [], True
    for r in result["rows"]:
        figures = [r["forward_ms"], r["backward_ms"], r["peak_1_mib"], r[f"peak_{inflight}_mib"]]
        ok &= all(math.isfinite(x) and x > 0 for x in figures) and r[f"peak_{inflight}_mib"] > r["peak_1_mib"]
        parts.append(
            f"stage {r['stage']}: fwd {r['forward_ms']:.1f} / bwd {r['backward_ms']:.1f} ms per mb, "
            f"+{r['per_microbatch_mib']:.1f} MiB per in-flight mb"
        )
    return f"{result['device']}: " + "; ".join(parts), ok


# ------------------------------------------------------------------------------------------ main
def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="pp 2, 4 micro-batches, 3 schedules, a tiny model")
    p.add_argument("--schedules", default=",".join(SCHEDULES))
    p.add_argument("--pp", type=_ints, default=[2, 4], help="pipeline sizes (default 2,4)")
    p.add_argument("--microbatches", type=_ints, default=[4, 8, 16])
    p.add_argument("--steps", type=int, default=2, help="timed steps per row (after one warm-up)")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds for one pp world's ranks")
    p.add_argument("--one-rank-stage", action="store_true", help="one device: stage 0 and the last stage")
    p.add_argument("--device", default=None, help="--one-rank-stage: cuda or cpu (default: cuda if visible)")
    p.add_argument(
        "--dtype", default=None, help="--one-rank-stage: bfloat16 / float32 (default bf16 on cuda)"
    )
    p.add_argument("--stages", type=int, default=2, help="--one-rank-stage: stages of the cut")
    p.add_argument("--inflight", type=int, default=4, help="--one-rank-stage: micro-batches kept at once")
    p.add_argument("--tiny", action="store_true", help="--one-rank-stage on CPU with a tiny model")
    p.add_argument(
        "--out", type=Path, default=None, help="results folder (default $BENCH_RESULTS_DIR or bench/results)"
    )
    p.add_argument("--name", default=None, help="JSON file name (default pipeline / pipeline_stages)")
    return p


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    if args.out is not None:
        os.environ[RESULTS_ENV] = str(args.out)
    if args.one_rank_stage:
        if args.tiny:
            args.device, args.hidden, args.layers, args.vocab, args.seq = "cpu", 64, 4, 256, 32
        elif "--hidden" not in " ".join(argv or sys.argv):  # the GPU default: Llama-3.2-1B widths
            args.hidden, args.layers, args.vocab, args.seq = 2048, 16, 128256, 2048
        result = one_rank_stages(args)
        line, ok = headline_one_rank(result, args.inflight)
        print(f"wrote {write_json(args.name or 'pipeline_stages', {'settings': vars(args), **result})}")
        print(f"HEADLINE: {line}")
        return 0 if ok else 1
    args.schedules = [s for s in args.schedules.split(",") if s]
    if args.quick:
        args.schedules, args.pp, args.microbatches = ["GPipe", "1F1B", "Interleaved1F1B"], [2], [4]
        args.hidden, args.layers, args.seq, args.vocab, args.steps = 64, 4, 32, 256, 1
    result = run_multi_rank(args)
    print(f"wrote {write_json(args.name or 'pipeline', {'settings': vars(args), **result})}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
