"""Run every benchmark with small CPU settings, one after the other (< 20 min on 2 cores):

    python bench/run_all.py            # tables on stdout, JSON in bench/results/
    python bench/run_all.py --only communication,overhead

Each script also runs on its own with larger settings (see its docstring). gpu_single runs
its tiny CPU form here (--tiny); the GPU checks are bench/gpu_all.sh.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
SMALL = {
    "communication": ["--seq", "64"],
    "overhead": ["--world", "2", "--steps", "16", "--seq", "256"],
    "startup": ["--worlds", "1,2,4,8"],
    "scaling": ["--worlds", "1,2,4", "--steps", "4", "--seq", "256"],
    "data_memory": ["--mb", "2"],
    "dedup_memory": ["--samples", "50000"],
    "qat_memory": ["--formats", "int4,int4/int8"],
    "loss_memory": ["--skip-logits"],
    "merge_memory": ["--layers", "2"],
    "qlora_memory": ["--layers", "2"],
    "long_context": ["--seqs", "512,1024,2048", "--attention-seqs", "4096"],
    "gpu_single": ["--tiny"],
    "family_differences": ["--layouts", "FSDP 2,CP 2"],
}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", default=None, help="comma-separated subset of " + ",".join(SMALL))
    args = ap.parse_args(argv)
    names = args.only.split(",") if args.only else list(SMALL)
    walls, failed = {}, []
    t_all = time.time()
    for name in names:
        print(f"\n=== {name} {' '.join(SMALL[name])}", flush=True)
        t0 = time.time()
        rc = subprocess.call([sys.executable, str(HERE / f"{name}.py"), *SMALL[name]])
        walls[name] = time.time() - t0
        if rc:
            failed.append(name)
    print(
        "\n"
        + ", ".join(f"{k} {v:.0f} s" for k, v in walls.items())
        + f"; total {time.time() - t_all:.0f} s"
        + (f"; FAILED: {failed}" if failed else "")
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
