"""Time from launch to the end of the first training step, and per-rank peak RSS, for world
sizes 1, 2, 4, 8 (FSDP over all ranks, tiny-llama), each launched as a real job:
``python -m ndparallel launch --nproc-per-node N bench/startup.py --worker``.

Each rank reports: seconds from launch to ``import`` done, to ``prepare`` done, to the end of
step 1, and its peak RSS (``ru_maxrss``). On 2 cores, 8 ranks importing torch at once dominate.

    python bench/startup.py --worlds 1,2,4,8
"""

from __future__ import annotations

import time

T_START = time.time()

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

HERE = Path(__file__).resolve().parent


def worker(out_dir: str) -> None:
    launched = float(os.environ["BENCH_LAUNCH_T"])
    import resource

    import torch
    import transformers  # noqa: F401

    sys.path.insert(0, str(HERE))
    from _common import local_micro_batch, nd_step

    from ndparallel import Accelerator, ParallelismConfig
    from ndparallel.models.presets import preset_config
    from ndparallel.tools.equivalence import (
        TrainSetup,
        build_model,
        make_global_batches,
        setup_optimizer,
    )

    t_import = time.time()
    acc = Accelerator(ParallelismConfig(dp_shard_size=-1), device="cpu")
    setup = TrainSetup(preset_config("tiny-llama"), steps=1, global_micro_batch=8, seq_len=256)
    model = build_model(setup)
    opt = setup_optimizer(setup, model.parameters())
    model, opt = acc.prepare(model, opt)
    t_prepare = time.time()
    micro = make_global_batches(setup)[0][0]
    nd_step(acc, model, opt, local_micro_batch(acc, micro))
    t_step = time.time()
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    Path(out_dir, f"rank{acc.process_index}.json").write_text(
        json.dumps(
            {
                "rank": acc.process_index,
                "world": acc.num_processes,
                "threads": torch.get_num_threads(),
                "import_s": t_import - launched,
                "prepare_s": t_prepare - launched,
                "first_step_s": t_step - launched,
                "peak_rss_bytes": rss,
            }
        )
    )
    acc.end_training()


def run_world(world: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ, BENCH_LAUNCH_T=repr(time.time()))
        t0 = time.time()
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "ndparallel",
                "launch",
                f"--nproc-per-node={world}",
                str(Path(__file__).resolve()),
                "--worker",
                tmp,
            ],
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        wall = time.time() - t0
        ranks = [json.loads(p.read_text()) for p in sorted(Path(tmp).glob("rank*.json"))]
    if proc.returncode != 0 or len(ranks) != world:
        return {"world": world, "error": proc.stderr[-2000:]}
    return {
        "world": world,
        "job_wall_s": wall,
        "ranks": ranks,
        "first_step_s": max(r["first_step_s"] for r in ranks),
        "import_s": max(r["import_s"] for r in ranks),
        "max_rss_mb": max(r["peak_rss_bytes"] for r in ranks) / 2**20,
        "mean_rss_mb": sum(r["peak_rss_bytes"] for r in ranks) / len(ranks) / 2**20,
    }


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worlds", default="1,2,4,8")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return worker(args.worker)
    sys.path.insert(0, str(HERE))
    from _common import print_table, write_json

    results = [run_world(int(w)) for w in args.worlds.split(",")]
    rows = [
        (
            r["world"],
            r.get("import_s", float("nan")),
            r.get("first_step_s", float("nan")),
            r.get("job_wall_s", float("nan")),
            r.get("mean_rss_mb", float("nan")),
            r.get("max_rss_mb", float("nan")),
        )
        if "error" not in r
        else (r["world"], "failed", "", "", "", "")
        for r in results
    ]
    print_table(
        "launch to first step (FSDP over all ranks, tiny-llama, seq 256)",
        ["world", "imports done s", "first step done s", "job wall s", "mean RSS MB", "max RSS MB"],
        rows,
    )
    for r in results:
        if "error" in r:
            print(f"world {r['world']} failed:\n{r['error']}")
    print(f"wrote {write_json('startup', {'results': results})}")


if __name__ == "__main__":
    main()
