"""Axolotl itself next to ``ndparallel preprocess``: writes the golden fixtures.

    python bench/peers/axolotl.py [--venv /work/venvs/axolotl] [--only CASE ...]

1. A side venv with Axolotl 0.19.0 (``--system-site-packages``, torch pinned to the installed
   2.13.0 by a constraints file so pip never pulls a CUDA build; Axolotl without its dependencies,
   then its pinned ones but the GPU-only and cloud ones: ``REQUIREMENTS``). The other peer scripts
   (``axolotl_loss.py``, ``axolotl_speed.py``) run in the venv this builds.
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

REQUIREMENTS = (
    "packaging==26.0 huggingface_hub==1.17.0 peft==0.20.0 tokenizers==0.23.1 transformers==5.16.1 "
    "accelerate==1.13.0 datasets==4.8.4 trl==1.9.0 hf_xet==1.4.3 kernels<0.17.0,>=0.16.0 "
    "typing-extensions==4.15.0 optimum==1.16.2 sentencepiece pydantic==2.12.5 addict fire PyYAML==6.0.3 "
    "requests einops colorama numba<1.0,>=0.63.1 numpy<3.0,>=2.1 typer==0.25.1 evaluate==0.4.1 scipy "
    "nvidia-ml-py==12.560.30 art python-dotenv==1.0.1 zstandard==0.22.0 fastcore langdetect==1.0.9 "
    "immutabledict==4.2.0 antlr4-python3-runtime==4.13.2 schedulefree==1.4.1 axolotl-contribs-lgpl==0.0.7 "
    "axolotl-contribs-mit==0.0.6 posthog==6.7.11 mistral-common==1.11.5 bitsandbytes==0.50.2 torchao==0.17.0"
).split()
"""Axolotl 0.19.0's pinned requirements but the GPU-only kernels (xformers, liger-kernel, fla-core,
flash-linear-attention: never imported on CPU) and the cloud / UI ones (gradio, modal, s3fs,
gcsfs, adlfs, ocifs, trackio, wandb, tensorboard, lm_eval, openenv-core); ``triton`` with
``--no-deps`` (imported, unused on CPU)."""


def ensure_venv(venv: Path) -> Path:
    """A side venv with Axolotl 0.19.0 (``--system-site-packages``: the installed torch is reused,
    pinned by a constraints file so pip never pulls another build)."""
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
        pip = [str(python), "-m", "pip", "install", "-q"]
        subprocess.run([*pip, "--no-deps", AXOLOTL], check=True)
        subprocess.run([*pip, "-c", str(constraints), *REQUIREMENTS], check=True)
        subprocess.run([*pip, "--no-deps", "triton"], check=True)
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
    parser.add_argument("--venv", type=Path, default=Path("/work/venvs/axolotl"))
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
