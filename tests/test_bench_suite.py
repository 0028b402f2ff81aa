"""bench/ is one suite: ``bench/run_all.py`` lists every benchmark (bench/gpu_all.sh's GPU steps among
them), and every script of bench/ is reached from it — named by the entry point or a GPU step, or
run / imported by one that is. A script nothing reaches is dead: wire it in or delete it."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"
ENTRY = BENCH / "run_all.py"


def _bench_files(bench: Path) -> list[Path]:
    return sorted(p for p in bench.rglob("*") if p.suffix in (".py", ".sh") and "results" not in p.parts)


def _code(path: Path) -> tuple[str, set[str]]:
    """What a file runs or imports: Python's string constants (docstrings left out) and imported
    modules; a shell script's lines without their comments."""
    text = path.read_text()
    if path.suffix == ".sh":
        lines = (re.sub(r"(^|\s)#.*$", "", line) for line in text.splitlines())
        return "\n".join(lines), set()
    tree = ast.parse(text)
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef))
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    strings = [
        n.value
        for n in ast.walk(tree)
        if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docstrings
    ]
    modules = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    modules |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    return "\n".join(strings), modules


def unreached(bench: Path, entry: Path) -> list[str]:
    """bench/'s scripts that ``entry`` does not reach, following what each reached file runs or imports."""
    files = _bench_files(bench)
    seen, todo = {entry}, [entry]
    while todo:
        code, modules = _code(todo.pop())
        for f in files:
            named = re.search(rf"(?<![\w.-]){re.escape(f.name)}\b", code) or f.stem in modules
            if f not in seen and named:
                seen.add(f)
                todo.append(f)
    return [str(f.relative_to(bench)) for f in files if f not in seen]


def test_every_bench_script_is_reached_from_the_entry_point():
    assert unreached(BENCH, ENTRY) == []


def test_the_reach_check_finds_a_stray_script(tmp_path):
    """Negative control: a script named only in a docstring or a comment is not reached."""
    (tmp_path / "run_all.py").write_text('"""Runs b.py, not c.py."""\nSCRIPTS = ["a.py"]\n')
    (tmp_path / "a.py").write_text("from _helper import x\n")
    (tmp_path / "_helper.py").write_text("x = 1\n")
    (tmp_path / "b.py").write_text("")
    (tmp_path / "c.sh").write_text("# c.sh is run by b.py\n")
    assert unreached(tmp_path, tmp_path / "run_all.py") == ["b.py", "c.sh"]


def _run_all(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ENTRY), *args], capture_output=True, text=True, timeout=60)


def test_the_list_names_every_benchmark_and_every_gpu_step():
    sys.path.insert(0, str(BENCH))
    try:
        import run_all
    finally:
        sys.path.remove(str(BENCH))
    listing = _run_all("--list")
    assert listing.returncode == 0, listing.stderr
    names = [line.split()[0] for line in listing.stdout.splitlines()[1:]]
    steps = subprocess.run(["bash", str(BENCH / "gpu_all.sh"), "--list"], capture_output=True, text=True)
    gpu = [f"gpu:{line.split()[0]}" for line in steps.stdout.splitlines()]
    assert names == [b.name for b in run_all.BENCHES] + gpu
    assert len(set(names)) == len(names)
    assert all((BENCH / b.script).is_file() for b in run_all.BENCHES)
    assert all(line.split()[1] == "GPU" for line in listing.stdout.splitlines() if line.startswith("gpu:"))


def test_an_unknown_benchmark_is_one_line_and_exit_2():
    out = _run_all("no_such_bench")
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        "run_all.py: no benchmark named no_such_bench (python bench/run_all.py --list)"
    ]
