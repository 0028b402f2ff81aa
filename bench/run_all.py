"""The benchmark suite's one entry point: lists every benchmark, runs one, some or all of them.

    python bench/run_all.py --list                 # every benchmark: name, what it needs, what it measures
    python bench/run_all.py                        # the quick CPU ones, small settings
    python bench/run_all.py --all                  # every CPU one, the slow simulations too
    python bench/run_all.py communication overhead # those (small settings; --full: the script's own)
    python bench/run_all.py 'gpu:*'                # the GPU steps: bash bench/gpu_all.sh, on a GPU machine
    python bench/run_all.py 'gpu:lora_*' --cpu-smoke   # GPU steps in their tiny CPU form

A benchmark is a script of bench/ that prints a table and writes JSON to bench/results/
(``$BENCH_RESULTS_DIR`` when set); each also runs alone (its docstring says how). ``needs`` says what
one needs besides this checkout's environment: ``GPU`` (a step of bench/gpu_all.sh, the one GPU
script: one budget, one device call), ``side venv`` (a peer tool installed by the script into a venv
of its own; needs the internet once), ``internet``. Names given are run in the order listed here; the
GPU steps together in one bench/gpu_all.sh call. Exit 1 when any failed, 2 on an unknown name.
"""

from __future__ import annotations

import argparse
import fnmatch
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
GPU_ALL = HERE / "gpu_all.sh"


@dataclass(frozen=True)
class Bench:
    name: str
    script: str  # relative to bench/
    what: str
    small: tuple[str, ...] = ()  # the quick settings the suite runs (--full: none)
    needs: str = ""  # "" (this environment, CPU), "side venv", "internet"
    slow: bool = False  # only with --all or by name


BENCHES = (
    Bench(
        "communication",
        "communication.py",
        "bytes per step per rank of each layout vs its floor",
        ("--seq", "64"),
    ),
    Bench(
        "overhead",
        "overhead.py",
        "ndparallel's step vs a plain FSDP2 loop, alternated",
        ("--world", "2", "--steps", "16", "--seq", "256"),
    ),
    Bench(
        "startup", "startup.py", "launch to first step, peak RSS per rank, world 1-8", ("--worlds", "1,2,4,8")
    ),
    Bench(
        "startup_gc",
        "startup_gc.py",
        "model-library imports with the collector paused vs plain",
        ("--rounds", "2"),
    ),
    Bench(
        "scaling",
        "scaling.py",
        "tokens/s vs world size per strategy (shape only)",
        ("--worlds", "1,2,4", "--steps", "4", "--seq", "256"),
    ),
    Bench(
        "checkpoint_async",
        "checkpoint_async.py",
        "sync vs async checkpoints, the preemption check",
        ("--rounds", "1", "--hidden", "128", "--layers", "2", "--vocab", "1024"),
    ),
    Bench(
        "memory",
        "memory.py",
        "train state per rank vs FSDP degree; host RSS while loading; LoRA state",
        ("--hidden", "256", "--layers", "2", "--vocab", "4096", "--intermediate", "512"),
    ),
    Bench(
        "moe_load_memory",
        "moe_load_memory.py",
        "host RSS per rank while loading a per-expert MoE checkpoint",
        ("--hidden", "128", "--layers", "2", "--intermediate", "256"),
    ),
    Bench(
        "mxfp4_load_memory",
        "mxfp4_load_memory.py",
        "host RSS per rank while loading MXFP4 experts",
        ("--hidden", "128", "--layers", "2", "--intermediate", "128"),
    ),
    Bench("data_memory", "data_memory.py", "private memory per rank vs dataset size", ("--mb", "2")),
    Bench(
        "dedup_memory",
        "dedup_memory.py",
        "exact deduplication's memory per distinct sample",
        ("--samples", "50000"),
    ),
    Bench(
        "loss_memory",
        "loss_memory.py",
        "one step's peak at vocab 131,072: chunked loss vs logits",
        ("--skip-logits",),
    ),
    Bench(
        "merge_memory", "merge_memory.py", "offline LoRA merge vs PEFT's merge_and_unload", ("--layers", "2")
    ),
    Bench("qlora_memory", "qlora_memory.py", "NF4 base bytes per rank, load peaks", ("--layers", "2")),
    Bench(
        "qat_memory",
        "qat_memory.py",
        "what QAT keeps for backward vs the planner",
        ("--formats", "int4,int4/int8"),
    ),
    Bench(
        "long_context",
        "long_context.py",
        "peak memory vs sequence length per long-context option",
        ("--seqs", "512,1024,2048", "--attention-seqs", "4096"),
    ),
    Bench(
        "cp_memory",
        "cp_memory.py",
        "CP attention memory per rank, ring vs allgather step time",
        ("--seq", "512", "--cps", "1,2", "--steps", "2"),
    ),
    Bench("pipeline", "pipeline.py", "each schedule's bubble and stage memory", ("--quick",)),
    Bench("plan_speed", "plan_speed.py", "`ndparallel plan`'s own CPU time", ("--runs", "1")),
    Bench("plan_validation", "plan_validation.py", "the planner vs measured CPU rows (memory, ranking)"),
    Bench(
        "simulate_heldout",
        "simulate_heldout.py",
        "`simulate` of shapes the planner was not tuned on vs the planner",
        ("--only", "vocab64k-h256-fsdp64", "gqa8-h512-fsdp32xtp2"),
        slow=True,
    ),
    Bench(
        "simulate_settings",
        "simulate_settings.py",
        "`plan --write-config` rows of each searched setting, `simulate`d, vs the planner",
        ("--only", "none", "selective"),
        slow=True,
    ),
    Bench(
        "simulate_scale",
        "simulate_scale.py",
        "`simulate` at worlds 64-1024 vs the planner; vs a real 8-rank run",
        ("--worlds", "64", "256"),
        slow=True,
    ),
    Bench(
        "simulate_long_context",
        "simulate_long_context.py",
        "the long-context planner terms vs `simulate` of a CP 8 rank",
        ("--seq", "8192"),
        slow=True,
    ),
    Bench(
        "simulate_meta_405b",
        "simulate_meta_405b.py",
        "Meta's 405B layout vs `simulate` of its first pipeline rank",
        ("--seq", "256"),
        slow=True,
    ),
    Bench(
        "gpu_single", "gpu_single.py", "the six one-GPU loops' CPU form (gpu:perf_2048 on a GPU)", ("--tiny",)
    ),
    Bench(
        "peer_accelerate",
        "peers/accelerate.py",
        "Accelerate itself beside the drop-in: losses, tokens/s, memory",
        ("--layouts", "fsdp4", "--steps", "2"),
    ),
    Bench(
        "trainer_door",
        "trainer_door.py",
        "the transformers Trainer door vs `ndparallel train` on one layout: tokens/s, memory",
        ("--steps", "6", "--rounds", "1"),
    ),
    Bench(
        "peer_hf_trainer",
        "peers/hf_trainer.py",
        "transformers' Trainer itself, one process: the door's fixtures (here into bench/results/)",
        ("--out-dir", str(HERE / "results" / "hf_trainer")),
        slow=True,
    ),
    Bench(
        "peer_axolotl",
        "peers/axolotl.py",
        "Axolotl's preprocess on 21 configs: writes tests/fixtures/axolotl/parity/",
        needs="side venv",
    ),
    Bench(
        "peer_axolotl_loss",
        "peers/axolotl_loss.py",
        "Axolotl's trainer vs `ndparallel train`: per-step losses",
        ("--steps", "3"),
        needs="side venv",
    ),
    Bench(
        "peer_axolotl_speed",
        "peers/axolotl_speed.py",
        "Axolotl's trainer vs `ndparallel train`: samples/s, real tokens/s, peak memory, losses",
        ("--pairs", "1", "--only", "alpaca"),
        needs="side venv",
    ),
    Bench(
        "peer_axolotl_rows",
        "peers/axolotl_rows.py",
        "Axolotl's packed rows per step, 1 and 2 CPU ranks: writes tests/fixtures/axolotl/parity/",
        needs="side venv",
    ),
    Bench(
        "gpu_wheels",
        "gpu_wheels.sh",
        "fetch the wheels a GPU run carries into .whl/ (once)",
        needs="internet",
    ),
)


@dataclass(frozen=True)
class GpuStep:
    name: str  # gpu:<the step's name in bench/gpu_all.sh>
    cap: str
    command: str


def gpu_steps() -> list[GpuStep]:
    """bench/gpu_all.sh's steps, as its ``--list`` prints them (the script stays their one list)."""
    listing = subprocess.run(
        ["bash", str(GPU_ALL), "--list"], capture_output=True, text=True, check=True
    ).stdout
    steps = []
    for line in listing.splitlines():
        name, cap, command = line.split(None, 2)
        steps.append(GpuStep(f"gpu:{name}", cap, command))
    return steps


def print_list(steps: list[GpuStep]) -> None:
    width = max(len(b.name) for b in BENCHES) + 2
    print(f"{'name':{width}}{'needs':12}what (script; small settings)")
    for b in BENCHES:
        needs = b.needs or ("CPU, slow" if b.slow else "CPU")
        small = " ".join(b.small)
        print(f"{b.name:{width}}{needs:12}{b.what} (bench/{b.script}{'; ' + small if small else ''})")
    for s in steps:
        print(f"{s.name:{width}}{'GPU':12}{s.command} (cap {s.cap}; bench/gpu_all.sh)")


def select(names: list[str], run_all: bool, steps: list[GpuStep]) -> tuple[list[Bench], list[GpuStep]]:
    if not names:
        return [b for b in BENCHES if not b.needs and (run_all or not b.slow)], []
    unknown = [n for n in names if not any(fnmatch.fnmatch(x.name, n) for x in (*BENCHES, *steps))]
    if unknown:
        print(
            f"run_all.py: no benchmark named {', '.join(unknown)} (python bench/run_all.py --list)",
            file=sys.stderr,
        )
        sys.exit(2)
    match = lambda x: any(fnmatch.fnmatch(x.name, n) for n in names)  # noqa: E731
    return [b for b in BENCHES if match(b)], [s for s in steps if match(s)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("names", nargs="*", help="benchmarks or globs (default: the quick CPU ones)")
    ap.add_argument("--only", default=None, help="comma-separated names (the same as naming them)")
    ap.add_argument("--list", action="store_true", help="print every benchmark, run nothing")
    ap.add_argument(
        "--all", action="store_true", help="with no names: every CPU benchmark, the slow ones too"
    )
    ap.add_argument("--full", action="store_true", help="each script's own (larger) settings")
    ap.add_argument("--cpu-smoke", action="store_true", help="GPU steps in their tiny CPU form")
    ap.add_argument("--out", default=None, help="gpu_all.sh's --out (default: its own)")
    args = ap.parse_args(argv)
    steps = gpu_steps()
    if args.list:
        print_list(steps)
        return 0
    names = [*args.names, *(args.only.split(",") if args.only else [])]
    benches, chosen_steps = select(names, args.all, steps)
    walls, failed = {}, []
    t_all = time.time()
    for b in benches:
        script = HERE / b.script
        cmd = ["bash", str(script)] if script.suffix == ".sh" else [sys.executable, str(script)]
        cmd += [] if args.full else list(b.small)
        print(f"\n=== {b.name}: {' '.join(cmd[1:])}", flush=True)
        t0 = time.time()
        if subprocess.call(cmd):
            failed.append(b.name)
        walls[b.name] = time.time() - t0
    if chosen_steps:
        only = ",".join(s.name.removeprefix("gpu:") for s in chosen_steps)
        cmd = ["bash", str(GPU_ALL), "--only", only]
        cmd += ["--cpu-smoke"] if args.cpu_smoke else []
        cmd += ["--out", args.out] if args.out else []
        print(f"\n=== GPU steps: {' '.join(cmd[1:])}", flush=True)
        t0 = time.time()
        if subprocess.call(cmd):
            failed.append("gpu_all.sh")
        walls["gpu_all.sh"] = time.time() - t0
    print(
        "\n"
        + ", ".join(f"{k} {v:.0f} s" for k, v in walls.items())
        + f"; total {time.time() - t_all:.0f} s"
        + (f"; FAILED: {failed}" if failed else "")
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
