"""What pausing Python's cyclic collector saves at the start of every ndparallel process that
builds a model (``runtime/startup.import_model_libraries``): the model libraries imported in a
fresh interpreter as they are (``plain``) and through it (``paused``), alternately, ``--rounds``
times each; the table gives the median seconds of CPU (user + sys) and wall, and the ratio.

    python bench/startup_gc.py [--rounds 5]      # JSON: bench/results/startup_gc.json
"""

from __future__ import annotations

import argparse
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import write_json  # noqa: E402

from ndparallel.runtime.startup import MODEL_LIBRARIES  # noqa: E402

FORMS = {
    "plain": f"import importlib\nfor m in {MODEL_LIBRARIES!r}: importlib.import_module(m)",
    "paused": "from ndparallel.runtime.startup import import_model_libraries\nimport_model_libraries()",
}


def _once(code: str) -> tuple[float, float]:
    """(wall, CPU) seconds of one fresh interpreter running ``code``."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)
    wall = time.perf_counter() - t
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    runs = {name: [] for name in FORMS}
    for _ in range(args.rounds):
        for name, code in FORMS.items():  # alternately: a drift of the machine's load hits both
            runs[name].append(_once(code))
    rows = {
        name: {"wall_s": statistics.median(w for w, _ in r), "cpu_s": statistics.median(c for _, c in r)}
        for name, r in runs.items()
    }
    ratio = rows["paused"]["cpu_s"] / rows["plain"]["cpu_s"]
    print(f"{'form':8} {'CPU s':>7} {'wall s':>7}   (median of {args.rounds}, {', '.join(MODEL_LIBRARIES)})")
    for name, row in rows.items():
        print(f"{name:8} {row['cpu_s']:7.2f} {row['wall_s']:7.2f}")
    print(f"paused / plain CPU: {ratio:.2f}")
    write_json(
        "startup_gc",
        {
            "rounds": args.rounds,
            "libraries": list(MODEL_LIBRARIES),
            "rows": rows,
            "paused_over_plain_cpu": ratio,
        },
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
