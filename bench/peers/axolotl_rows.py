"""Axolotl's packed rows: which of its examples each row of each step holds, recorded by running its
trainer, for ``sample_packing_order: multipack`` (``tests/test_multipack.py``).

    python bench/peers/axolotl_rows.py [--venv /work/venvs/axolotl] [--work DIR]

The parity fixtures' tokenizer, alpaca data and seeded tiny Llama (``tests/fixtures/axolotl/parity/``)
and one packed config (``CONFIG``: ``sample_packing: true``, ``sequence_len`` 512, so about three
samples share a row; 2 epochs, so the second epoch's packing shows), trained by Axolotl 0.19.0 on
1 CPU process and on 2 (``torchrun``, gloo, through ``axolotl_cpu_ranks.py``). A plugin
(``axolotl_rows_plugin.py``) records, per micro-batch each rank trains, its rows as indices of
Axolotl's prepared examples (its shuffled dataset). Written to the fixture
``tests/fixtures/axolotl/parity/multipack_rows.json`` with each example's length and a CRC-32 of
its ``input_ids`` (so a test knows the examples are the same), Axolotl's per-step losses, the
date and the versions.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
FIXTURES = REPO / "tests" / "fixtures" / "axolotl" / "parity"

sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE] + [str(HERE), str(HERE.parent)]
from axolotl_loss import CONFIG as LOSS_CONFIG  # noqa: E402
from axolotl_loss import axolotl_steps, offline_env, run, versions  # noqa: E402

CONFIG = {
    **{k: v for k, v in LOSS_CONFIG.items() if k != "sample_packing"},
    "sequence_len": 512,
    "micro_batch_size": 2,
    "num_epochs": 2,
    "sample_packing": True,
    "gradient_accumulation_steps": 1,
}
"""The shared keys; ``base_model``, ``datasets`` and the paths are added."""


def record(python: Path, work: Path, nproc: int) -> dict:
    """Axolotl's trainer on ``nproc`` CPU processes: each rank's rows per micro-batch, its losses,
    and its examples' lengths and CRC-32s."""
    run_dir = work / f"dp{nproc}"
    shutil.rmtree(run_dir, ignore_errors=True)
    (run_dir / "plugin").mkdir(parents=True)
    shutil.copy(HERE / "axolotl_rows_plugin.py", run_dir / "plugin")
    cfg = {
        "base_model": str(FIXTURES / "model"),
        "datasets": [{"path": str(FIXTURES / "data" / "alpaca.jsonl"), "type": "alpaca", "ds_type": "json"}],
        **CONFIG,
        "dataset_prepared_path": str(run_dir / "prepared"),
        "output_dir": str(run_dir / "out"),
        "plugins": ["axolotl_rows_plugin.RecordRows"],
    }
    path = run_dir / "axolotl.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    cmd = [str(python), "-m", "axolotl.cli.train", str(path)]
    extra = {"PYTHONPATH": str(run_dir / "plugin")}  # the plugin only: this folder's axolotl.py would shadow
    if nproc > 1:
        cmd = [str(python), "-m", "torch.distributed.run", f"--nproc-per-node={nproc}"]
        cmd += [str(HERE / "axolotl_cpu_ranks.py"), str(path)]
        extra["ACCELERATE_USE_CPU"] = "true"
    secs = run(cmd, offline_env(**extra), run_dir, run_dir / "axolotl.log")
    print(f"axolotl on {nproc} process(es): {secs:.0f} s", flush=True)
    ranks = [json.loads((run_dir / "out" / f"rows_rank{r}.json").read_text()) for r in range(nproc)]
    steps = [[m["rows"] for m in rank["micro_batches"]] for rank in ranks]
    return {
        "nproc": nproc,
        "command": " ".join(cmd),
        "rows": [list(step) for step in zip(*steps, strict=True)],  # [step][rank][row] -> examples
        "losses": [s["loss"] for s in axolotl_steps(run_dir / "out")],
        "examples": _examples(python, run_dir / "prepared"),
    }


def _examples(python: Path, prepared: Path) -> list[list[int]]:
    """``[length, crc32(input_ids as int32)]`` of each prepared example (read in Axolotl's venv)."""
    probe = (
        "import datasets, glob, json, sys, zlib, numpy as np; "
        "p = glob.glob(sys.argv[1] + '/*/dataset_info.json')[0].rsplit('/', 1)[0]; "
        "ds = datasets.load_from_disk(p); "
        "crc = lambda x: zlib.crc32(np.asarray(x, np.int32).tobytes()); "
        "print(json.dumps([[len(x), crc(x)] for x in ds['input_ids']]))"
    )
    env = offline_env()
    env.pop("PYTHONPATH", None)
    out = subprocess.run([str(python), "-c", probe, str(prepared)], capture_output=True, text=True, env=env)
    if out.returncode:
        raise SystemExit(out.stderr[-2000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--venv", type=Path, default=Path("/work/venvs/axolotl"))
    parser.add_argument("--work", type=Path, default=None, help="default: a new temporary folder")
    parser.add_argument("--nproc", type=int, nargs="+", default=[1, 2])
    args = parser.parse_args(argv)
    work = (args.work or Path(tempfile.mkdtemp(prefix="axolotl-rows-"))).resolve()
    python = args.venv / "bin" / "python"
    runs = [record(python, work, n) for n in args.nproc]
    env = offline_env()
    env.pop("PYTHONPATH", None)
    config = {"base_model": "model", "datasets": [{"path": "data/alpaca.jsonl", "type": "alpaca"}], **CONFIG}
    fixture = FIXTURES / "multipack_rows.json"
    fixture.write_text(
        json.dumps(
            {
                "axolotl": versions(python, env).get("axolotl"),
                "command": "python bench/peers/axolotl_rows.py (Axolotl's trainer, 1 and 2 CPU processes)",
                "date": time.strftime("%Y-%m-%d", time.gmtime()),
                "versions": versions(python, env),
                "config": config,
                "runs": runs,
            },
            separators=(",", ":"),
        )
        + "\n"
    )
    print(fixture)
    return 0


if __name__ == "__main__":
    sys.exit(main())
