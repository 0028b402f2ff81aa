"""Whether ``ndparallel plan`` answers as another checkout does: ~30 varied requests (the table,
``--json``, ``--explain``, ``--top``, pinned settings, ``--host-mem``, ``--max-seq-len``), each run
by this tree's ``src`` and by ``--against SRC`` (e.g. main's), stdout, stderr and exit code compared
byte for byte. A change that only makes the search faster must leave every one identical.

    python bench/plan_outputs.py --against /work/main/src [--only 70B]
    python bench/plan_speed.py --compare-outputs /work/main/src
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
H100 = "--gpus-per-node 8 --gpu h100-80gb"
B405 = f"--base-model llama-3.1-405b --gpus 8192 {H100} --sequence-len 8192 --global-batch-tokens 16777216"
B70 = f"--base-model llama-3.1-70b --gpus 64 {H100} --sequence-len 8192"
B8 = f"--base-model llama-3.1-8b --gpus 8 {H100}"
META = "pp16:1x64x1x8"
REQUESTS = [
    B405,
    f"{B405} --top 5",
    f"{B405} --json",
    f"{B405} --explain {META}",
    f"{B405} --explain 8x128x1x8",
    f"{B405} --ac-policy selective --no-reshard-after-forward --activation-offloading",
    f"{B405} --host-mem 2TB --top 20",
    f"{B405} --pipeline-schedule Interleaved1F1B --pipeline-virtual-stages 2",
    B70,
    f"{B70} --json",
    f"{B70} --top 5 --show-rejected",
    f"{B70} --explain 1x8x1x8",
    f"{B70} --explain pp4:1x2x1x8",
    f"{B70} --ac-policy selective",
    f"{B70} --activation-offloading --host-mem 1TB",
    f"{B70} --no-reshard-after-forward --micro-batch-size 2",
    f"{B70} --activation-checkpointing off",
    f"{B70} --no-pipeline-parallel --json",
    f"{B70} --pipeline-schedule 1F1B --unsharded-grad-accumulation on",
    f"{B70} --global-batch-size 512 --top 15",
    B8,
    f"{B8} --json",
    f"{B8} --sequence-len 8192 --explain 1x8x1x1",
    f"{B8} --sequence-len 8192 --ac-policy full --host-mem 512GB",
    f"{B8} --adapter lora --top 5",
    f"--base-model llama-3.2-3b --gpus 16 {H100} --max-seq-len",
    f"--base-model llama-3.2-3b --gpus 16 {H100} --max-seq-len --ac-policy selective --json",
    f"--base-model qwen3-30b-a3b --gpus 64 {H100} --sequence-len 4096",
    "--base-model llama-3.1-70b --gpus 128 --gpu a100-80gb --sequence-len 4096 --tiled-mlp",
    "--base-model llama-3.1-8b --gpus 16 --gpu h200 --sequence-len 131072 --top 5",
]


def run(args: str, src: str) -> tuple[int, bytes, bytes]:
    env = {**os.environ, "PYTHONPATH": src, "COLUMNS": "160", "NO_COLOR": "1"}
    cmd = [sys.executable, "-m", "ndparallel", "plan", *args.split()]
    p = subprocess.run(cmd, capture_output=True, env=env)
    return p.returncode, p.stdout, p.stderr


def compare(args: str, src: str, against: str) -> tuple[str, bool]:
    return args, run(args, src) == run(args, against)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--against", required=True, help="the other checkout's src directory")
    ap.add_argument("--src", default=str(ROOT / "src"))
    ap.add_argument("--only", default="", help="only the requests containing this text")
    ap.add_argument("--jobs", type=int, default=2)
    opts = ap.parse_args(argv)
    todo = [r for r in REQUESTS if opts.only in r]
    with ThreadPoolExecutor(opts.jobs) as pool:
        results = list(pool.map(lambda r: compare(r, opts.src, opts.against), todo))
    for args, same in results:
        print(f"{'identical' if same else 'DIFFERENT'}  {args}", flush=True)
    differ = sum(not same for _, same in results)
    print(f"{len(results) - differ} identical, {differ} different")
    return 1 if differ else 0


if __name__ == "__main__":
    raise SystemExit(main())
