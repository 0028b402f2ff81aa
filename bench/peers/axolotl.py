"""Axolotl itself next to ``ndparallel preprocess``: writes the golden fixtures.

    python bench/peers/axolotl.py [--venv /work/peers-venv] [--only CASE ...]

1. A side venv with Axolotl 0.19.0 (``--system-site-packages``, torch pinned to the installed
   2.13.0 by a constraints file so pip never pulls a CUDA build; GPU-only extras are not asked for).
2. The inputs (``axolotl_inputs.py``: local data, a local BPE tokenizer with a ChatML template, one
   config per case) written to ``tests/fixtures/axolotl/parity/``.
3. ``axolotl preprocess CASE.yaml``'s own steps per case (``axolotl_runner.py``, all cases in one
   process of the venv: Axolotl's imports alone take minutes on a loaded CPU); the training
   examples it prepares are written as ``expected/CASE.json``: per example ``input_ids``,
   ``labels`` (-100 = not trained) and ``position_ids`` where Axolotl adds them, the records read
   and the examples kept (the difference: dropped), Axolotl's version and the command, and the
   warnings Axolotl logged.

The suite's ``tests/test_axolotl_parity.py`` compares ``ndparallel``'s data pipeline with these
files; no Axolotl is needed there. Not part of the suite's dependencies.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
FIXTURES = REPO / "tests" / "fixtures" / "axolotl" / "parity"
AXOLOTL = "axolotl==0.19.0"

# this folder's files are named after the tools they compare with (accelerate.py): last on the path
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE] + [str(HERE)]
from axolotl_inputs import write_inputs  # noqa: E402


def ensure_venv(venv: Path) -> Path:
    python = venv / "bin" / "python"
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True)
    probe = subprocess.run(
        [str(python), "-c", "import axolotl; print(axolotl.__version__)"], capture_output=True, text=True
    )
    if probe.returncode != 0:
        constraints = venv / "constraints.txt"
        import torch

        constraints.write_text(f"torch=={torch.__version__.split('+')[0]}\n")
        subprocess.run(
            [str(python), "-m", "pip", "install", "-q", "-c", str(constraints), AXOLOTL], check=True
        )
    return python


def axolotl_version(python: Path) -> str:
    return subprocess.run(
        [str(python), "-c", "import axolotl; print(axolotl.__version__)"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()


def axolotl_config(cfg: dict, inputs: Path, work: Path) -> dict:
    """The case as Axolotl runs it: absolute paths, a model to read the tokenizer from, no hub."""
    out = json.loads(json.dumps(cfg))
    for d in out["datasets"]:
        d["path"] = str(inputs / d["path"])
        d.setdefault("ds_type", "json")
    out.update(
        base_model=str(inputs / "model"),
        dataset_prepared_path=str(work / "prepared"),
        output_dir=str(work / "out"),
        num_epochs=1,
        learning_rate=1e-4,
        gradient_accumulation_steps=1,
        val_set_size=0,
        shuffle_merged_datasets=False,
    )
    return out


def run_cases(python: Path, cases: dict[str, dict], inputs: Path, version: str) -> dict[str, dict]:
    """Every case through Axolotl's preprocess steps, in one process of the venv."""
    work = Path(tempfile.mkdtemp(prefix="axolotl-peer-"))
    paths = []
    for name, cfg in cases.items():
        (work / name).mkdir()
        path = work / f"{name}.yaml"
        path.write_text(yaml.safe_dump(axolotl_config(cfg, inputs, work / name), sort_keys=False))
        paths.append(str(path))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    env.pop("PYTHONPATH", None)
    runner = [str(python), "-P", str(HERE / "axolotl_runner.py"), str(work)]  # -P: not this folder
    subprocess.run(runner + paths, check=True, env=env, cwd=work)
    out = {}
    for name, cfg in cases.items():
        got = json.loads((work / f"{name}.json").read_text())
        records = sum(
            1
            for d in cfg["datasets"]
            for line in (inputs / d["path"]).read_text().splitlines()
            if line.strip()
        )
        kept = len(got.get("examples", []))
        out[name] = {
            "case": name,
            "config": cfg,
            "axolotl": version,
            "command": "axolotl preprocess CASE.yaml (its steps: axolotl.cli.config.load_cfg, "
            "axolotl.common.datasets.load_datasets), bench/peers/axolotl.py",
            "records": records,
            "kept": kept,
            "dropped": records - kept if "examples" in got else None,
            **got,
        }
    shutil.rmtree(work, ignore_errors=True)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--venv", type=Path, default=Path("/work/peers-venv"))
    parser.add_argument("--only", nargs="*")
    args = parser.parse_args(argv)
    python = ensure_venv(args.venv)
    version = axolotl_version(python)
    cases = write_inputs(FIXTURES)
    (FIXTURES / "cases.json").write_text(json.dumps(cases, indent=1) + "\n")
    expected = FIXTURES / "expected"
    expected.mkdir(exist_ok=True)
    chosen = {n: c for n, c in cases.items() if not args.only or n in args.only}
    for name, result in run_cases(python, chosen, FIXTURES, version).items():
        (expected / f"{name}.json").write_text(json.dumps(result, separators=(",", ":")) + "\n")
        status = f"{result['kept']} of {result['records']} kept" if "examples" in result else result["error"]
        print(f"{name}: {status}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
