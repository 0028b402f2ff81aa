"""First contact: the built wheel, installed with its core dependencies alone, runs every command.

``python scripts/wheel_check.py`` builds the wheel of this checkout, makes a fresh virtual
environment that sees this machine's installed torch and nothing else of it (a ``.pth`` file
pointing at a directory that links only torch's own files; pip then installs torch's and our
declared dependencies, no extras), installs the wheel there and runs, on a tiny config in a
scratch directory: ``plan``, ``preprocess``, ``train`` (2 ranks, saving a checkpoint),
``verify``, ``simulate``, ``export``, ``launch`` of a script using the Python API, and a
feature of each extra asked for without it (one line naming the extra, exit 2, no traceback).
Any import error, traceback or unexpected exit code fails it (exit 1). The environment it runs
from is not changed. ``.ci/run`` runs it after the suite (~2-4 minutes on 2 cores).

``--drop DIST`` builds the wheel with that dependency removed from pyproject.toml: the negative
control (``--drop datasets`` must fail: no other dependency brings it). A dependency another one
brings (numpy through datasets, pydantic through huggingface-hub's typer) cannot fail here, which
is why ``tests/test_dependencies.py`` checks the imports themselves.
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import os
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXTRA_MODULES = ("peft", "torchao", "matplotlib", "accelerate", "wandb", "psutil")
"""Modules of the dev environment the fresh one must not see (extras, or nobody's dependency)."""
PROBLEM = re.compile(r"Traceback \(most recent call last\)|ModuleNotFoundError|ImportError|No module named")

CONFIG = """\
base_model: tiny-llama
tokenizer_vocab_size: 512
datasets:
  - path: builtin:stdlib
    max_bytes: 60000
sequence_len: 32
micro_batch_size: 2
max_steps: 2
save_steps: 2
learning_rate: 3.0e-3
logging_steps: 1
device: cpu
output_dir: out
dp_shard_size: 2
"""

SCRIPT = """\
import torch
from ndparallel import Accelerator, ParallelismConfig
from ndparallel.models.adapters import lora_config

acc = Accelerator(parallelism_config=ParallelismConfig(dp_shard_size=2))
model = acc.load_model("tiny-llama")
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
model, optimizer = acc.prepare(model, optimizer)
ids = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(acc.process_index))
batch = {"input_ids": ids[:, :-1], "shift_labels": ids[:, 1:], "position_ids": torch.arange(16).expand(2, 16)}
n = acc.global_num_items([batch])
loss = acc.forward_loss(model, batch, n)
acc.backward(loss, num_items_in_batch=n)
norm = acc.clip_grad_norm_(model.parameters(), 1.0)
optimizer.step()
try:
    lora_config(r=4)
    raise SystemExit("lora_config ran without peft")
except ImportError as e:
    said = str(e)
assert "pip install 'ndparallel[lora]'" in said, said
for door, extra in (("ndparallel.transformers", "trainer"), ("ndparallel.trl", "trl")):
    try:
        __import__(door)
        raise SystemExit(f"{door} imported without its extra")
    except ImportError as e:
        assert f"pip install 'ndparallel[{extra}]'" in str(e), e
acc.print(f"python api: loss {loss.item():.4f} grad norm {norm.item():.4f}; LoRA: {said}")
acc.end_training()
"""


@dataclass
class Step:
    name: str
    args: list[str]
    expect: int = 0
    needle: str = ""
    """A text the output must hold."""


def steps() -> list[Step]:
    refused = [  # every extra's feature, two runs (LoRA and QLoRA exclude each other, as QAT and QLoRA)
        (
            "qlora,fp8,trackers",
            ["adapter=qlora", "load_in_4bit=true", "fp8=true", "optimizer=adamw_8bit", "wandb_project=p"],
        ),
        ("lora,qat", ["adapter=lora", "qat={weight_dtype: int4, group_size: 16}"]),
    ]
    return [
        Step("plan", ["plan", "--config", "cfg.yaml", "--gpus", "8", "--gpu", "h100-80gb"]),
        Step("preprocess", ["preprocess", "cfg.yaml"]),
        Step("train", ["train", "cfg.yaml"], needle="pip install 'ndparallel[plot]'"),
        Step("verify", ["verify", "cfg.yaml", "--steps", "2"], needle="PASS"),
        Step("simulate", ["simulate", "cfg.yaml", "--world-size", "4", "--set", "dp_shard_size=4"]),
        Step("export", ["export", "out", "exported"]),
        Step("launch", ["launch", "--nproc-per-node", "2", "api.py"], needle="python api: loss"),
        Step("plot", ["plot", "out"], expect=2, needle="pip install 'ndparallel[plot]'"),
        *(
            Step(
                f"train --set {' --set '.join(s)}",
                ["train", "cfg.yaml", *(f"--set={x}" for x in s)],
                2,
                f"'ndparallel[{e}]'",
            )
            for e, s in refused
        ),
    ]


def output_problems(step: Step, code: int, out: str) -> list[str]:
    """What is wrong with one command's run: its exit code, an import error or a traceback in its
    output, the text it must print (and, for a refusal, more than one line on stderr)."""
    bad = [f"exit {code}, expected {step.expect}"] if code != step.expect else []
    bad += [f"printed: {line.strip()}" for line in out.splitlines() if PROBLEM.search(line)][:3]
    if step.needle and step.needle not in out:
        bad.append(f"did not print {step.needle!r}")
    return bad


def drop_requirement(pyproject: str, dist: str) -> str:
    """``pyproject`` without ``dist`` among [project] dependencies (the negative control)."""
    pattern = re.compile(rf'^\s*"{re.escape(dist)}[<>=!~ ;\[][^"]*",\n', re.M | re.I)
    out, n = pattern.subn("", pyproject, count=1)
    if not n:
        raise SystemExit(f"wheel_check: {dist} is not a dependency in pyproject.toml")
    return out


def build_wheel(work: Path, drop: str | None) -> Path:
    """The wheel of this checkout's sources (copied: the checkout gets no build/ or egg-info)."""
    src = work / "src-copy"
    shutil.copytree(ROOT / "src", src / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    shutil.copy(ROOT / "README.md", src)
    pyproject = (ROOT / "pyproject.toml").read_text()
    (src / "pyproject.toml").write_text(drop_requirement(pyproject, drop) if drop else pyproject)
    dist = work / "dist"
    # this environment's setuptools where it is new enough (no download), else pip's isolated build
    isolation = ["--no-build-isolation"] if _version("setuptools") >= (68,) else []
    run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", *isolation, "-w", dist, src])
    return next(dist.glob("ndparallel-*.whl"))


def _version(dist: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in re.findall(r"\d+", md.version(dist))[:2])
    except md.PackageNotFoundError:
        return ()


def torch_only_venv(work: Path) -> Path:
    """A venv whose only package is this machine's torch (linked; its own dependencies and ours
    are then installed by pip); returns its python."""
    torch_dist = md.distribution("torch")
    site = Path(torch_dist.locate_file(""))
    tops = {Path(str(f)).parts[0] for f in torch_dist.files or []}
    tops |= {p.name for p in site.glob("torch-*.dist-info")}
    linked = work / "torch-only"
    linked.mkdir()
    for top in sorted(tops):
        if (site / top).exists() and not top.startswith(".."):
            (linked / top).symlink_to(site / top)
    venv = work / "venv"
    # pip >= 22.3 installs into it from here (`pip --python`); an older one needs the venv's own pip
    run([sys.executable, "-m", "venv", *(["--without-pip"] * _pip_targets_others()), venv])
    python = venv / "bin" / "python"
    where = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    purelib = Path(subprocess.check_output([python, "-c", where], text=True).strip())
    (purelib / "torch_only.pth").write_text(f"{linked}\n")
    return python


def _pip_targets_others() -> bool:
    return _version("pip") >= (22, 3)


def pip(python: Path) -> list:
    """The pip command that installs into ``python``'s environment."""
    return (
        [sys.executable, "-m", "pip", "--python", python] if _pip_targets_others() else [python, "-m", "pip"]
    )


def run(cmd, **kwargs) -> None:
    subprocess.run([str(c) for c in cmd], check=True, **kwargs)


def clean_env(venv_bin: Path) -> dict[str, str]:
    """The environment of the commands: this venv first on PATH, nothing of the caller's Python
    path, no Hub access."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV", "NDPARALLEL_"))}
    env.update(PATH=f"{venv_bin}{os.pathsep}{env.get('PATH', '')}", HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    return env


def check(work: Path, drop: str | None) -> list[str]:
    t0 = time.monotonic()
    wheel = build_wheel(work, drop)
    python = torch_only_venv(work)
    run([*pip(python), "install", "-q", "--no-compile", wheel])
    print(f"wheel_check: {wheel.name} and its core dependencies installed ({time.monotonic() - t0:.0f} s)")
    seen = subprocess.run(
        [python, "-c", f"import importlib.util as u; print([m for m in {EXTRA_MODULES} if u.find_spec(m)])"],
        capture_output=True,
        text=True,
        env=clean_env(python.parent),
    ).stdout.strip()
    if seen != "[]":
        return [f"the fresh environment sees packages of this one: {seen}"]
    runs = work / "runs"
    runs.mkdir()
    (runs / "cfg.yaml").write_text(CONFIG)
    (runs / "api.py").write_text(textwrap.dedent(SCRIPT))
    failures = []
    for step in steps():
        t = time.monotonic()
        proc = subprocess.run(
            [python.parent / "ndparallel", *step.args],
            cwd=runs,
            env=clean_env(python.parent),
            capture_output=True,
            text=True,
            timeout=600,
        )
        out = proc.stdout + proc.stderr
        bad = output_problems(step, proc.returncode, out)
        print(f"wheel_check: {step.name}: {'ok' if not bad else 'FAILED'} ({time.monotonic() - t:.0f} s)")
        if bad:
            failures.append(f"{step.name}: " + "; ".join(bad))
            print(textwrap.indent(out[-3000:], "    "))
    return failures


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--drop", metavar="DIST", help="remove this dependency first (negative control)")
    parser.add_argument("--keep", metavar="DIR", help="work in DIR and keep it (default: a removed temp dir)")
    args = parser.parse_args(argv)
    if args.keep and Path(args.keep).exists() and any(Path(args.keep).iterdir()):
        parser.error(f"--keep {args.keep}: not empty (give a new directory)")
    work = Path(args.keep or tempfile.mkdtemp(prefix="ndparallel-wheel-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        failures = check(work, args.drop)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    for f in failures:
        print(f"wheel_check: FAILED {f}", file=sys.stderr)
    ok = "every command ran from the wheel with its core dependencies"
    print(f"wheel_check: {'FAILED' if failures else ok}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
