"""pyproject.toml lists what the code imports: every third-party module ``src/ndparallel`` imports
(AST, function bodies included) comes from a declared dependency or from an optional extra, an
extra's modules are imported only inside functions (so the core commands never import one), the
extras table the code names them from (``runtime/extras.py``) is pyproject's, and every lower bound
is met by the environment the suite runs in. ``scripts/wheel_check.py`` (run by ``.ci/run``) is the
running half: the built wheel, with its core dependencies alone, runs every command."""

from __future__ import annotations

import ast
import functools
import importlib.metadata as md
import re
import sys
import tomllib
from pathlib import Path

from ndparallel.runtime.extras import EXTRAS

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "ndparallel"
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _name(requirement: str) -> str:
    """The normalised distribution name of a requirement string (PEP 503)."""
    return re.sub(r"[-_.]+", "-", re.match(r"[A-Za-z0-9._-]+", requirement).group()).lower()


def _third_party_imports(package: Path) -> dict[str, dict[str, bool]]:
    """Top-level module -> {file: imported at module level} for every import outside the standard
    library and ndparallel."""
    found: dict[str, dict[str, bool]] = {}
    for path in package.rglob("*.py"):
        tree = ast.parse(path.read_text())
        nested = {
            id(n)
            for fn in ast.walk(tree)
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))
            for n in ast.walk(fn)
        }
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top in sys.stdlib_module_names or top == "ndparallel":
                    continue
                where = found.setdefault(top, {})
                key = str(path.relative_to(package))
                where[key] = where.get(key, False) or id(node) not in nested
    return found


@functools.cache
def _providers() -> dict[str, list[str]]:
    return md.packages_distributions()


def _distribution(module: str) -> str:
    dists = _providers().get(module)
    assert dists, f"{module} is imported but no installed distribution provides it"
    return _name(dists[0])


DOORS = {"trl": "trl/__init__.py"}
"""An extra's package the door for it imports at module level (that module exists for the extra;
its first line is the extra's ``require``, and no core module imports a door: test_layout)."""


def _dependency_problems(
    imports: dict, core: set[str], extras: dict[str, set[str]], modules: dict
) -> list[str]:
    """What is wrong with ``imports`` (``_third_party_imports``) against the declared ``core``
    distributions, pyproject's ``extras`` (name -> distributions) and ``modules`` (``EXTRAS``)."""
    bad = []
    behind_extra = {m for ms in modules.values() for m in ms}
    for module, files in sorted(imports.items()):
        dist = _distribution(module)
        if dist in core:
            continue
        if module not in behind_extra:
            bad.append(f"{module} ({dist}) is neither a dependency nor an extra's: {sorted(files)}")
            continue
        for extra, ms in modules.items():
            if module in ms and dist not in extras.get(extra, set()):
                bad.append(f"{module}: pyproject's extra {extra!r} does not list {dist}")
        at_top = sorted(f for f, top in files.items() if top and DOORS.get(module) != f)
        if at_top:
            bad.append(f"{module} is an extra's but imported at module level in {at_top}")
    return bad


def _core() -> set[str]:
    return {_name(r) for r in PROJECT["dependencies"]}


def _extras() -> dict[str, set[str]]:
    return {extra: {_name(r) for r in reqs} for extra, reqs in PROJECT["optional-dependencies"].items()}


def test_every_import_is_a_dependency_or_an_extras():
    imports = _third_party_imports(PACKAGE)
    assert {"torch", "numpy", "pyarrow", "filelock", "peft", "matplotlib"} <= set(imports)  # not vacuous
    assert _dependency_problems(imports, _core(), _extras(), EXTRAS) == []


def test_the_checker_finds_an_undeclared_import_and_an_extra_at_module_level(tmp_path):
    """Negative control: numpy used but not declared (it comes through datasets), psutil declared
    nowhere, and an extra's package (peft) imported at the top of a module."""
    pkg = tmp_path / "ndparallel"
    pkg.mkdir()
    (pkg / "a.py").write_text("import numpy\nimport peft\n\ndef f():\n    import psutil\n")
    core = _core() - {"numpy"}
    problems = _dependency_problems(_third_party_imports(pkg), core, _extras(), EXTRAS)
    assert len(problems) == 3, problems
    assert "numpy (numpy) is neither" in problems[0] and "peft is an extra's" in problems[1]
    assert problems[2].startswith("psutil (psutil) is neither")


def test_the_extras_table_is_pyprojects():
    """Every extra the code names exists in pyproject and lists the distributions of its modules."""
    extras = _extras()
    for extra, modules in EXTRAS.items():
        assert extra in extras, f"runtime/extras.py names {extra!r}, which pyproject does not define"
        assert {_distribution(m) for m in modules} <= extras[extra], extra
    assert set(extras) - set(EXTRAS) == {"dev"}


def test_lower_bounds_are_met_by_the_suites_environment():
    """Each requirement has a lower bound, and the installed version (what the suite runs against)
    satisfies it; the Python running the suite is within requires-python, which the classifiers say."""
    reqs = PROJECT["dependencies"] + [r for rs in PROJECT["optional-dependencies"].values() for r in rs]
    for req in reqs:
        if req.startswith("ruff=="):
            continue
        bound = re.search(r">=([0-9][0-9.]*)", req)
        assert bound, f"{req}: no lower bound"
        assert _version(md.version(_name(req))) >= _version(bound.group(1)), req
    low, high = re.fullmatch(r">=3\.(\d+),<3\.(\d+)", PROJECT["requires-python"]).groups()
    assert int(low) <= sys.version_info.minor < int(high)
    said = {c.rsplit(" ", 1)[1] for c in PROJECT["classifiers"] if re.search(r"Python :: 3\.\d+$", c)}
    assert said == {f"3.{m}" for m in range(int(low), int(high))}


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.match(r"[0-9.]*[0-9]", text).group().split("."))


def _wheel_check():
    """scripts/wheel_check.py (a script, not a package module)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "ndparallel_wheel_check", ROOT / "scripts" / "wheel_check.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up there
    spec.loader.exec_module(module)
    return module


def test_the_wheel_check_can_fail():
    """Its negative control drops exactly the named dependency (``--drop datasets``: nothing else
    brings it; run by hand, it fails), and an import error, a traceback or an unexpected exit fails
    a step."""
    check = _wheel_check()
    text = (ROOT / "pyproject.toml").read_text()
    dropped = check.drop_requirement(text, "datasets")
    assert [line for line in text.splitlines() if line not in dropped.splitlines()] == [
        '    "datasets>=5.2",'
    ]
    step = check.Step("simulate", ["simulate"], needle="")
    assert check.output_problems(step, 0, "ndparallel simulate: FSDP 4 on 4 rank(s)\n") == []
    crash = "[rank0]: Traceback (most recent call last):\n[rank0]: ModuleNotFoundError: No module named 'x'\n"
    assert len(check.output_problems(step, 1, crash)) == 3  # the exit code and both lines
    refusal = check.Step("plot", ["plot"], expect=2, needle="'ndparallel[plot]'")
    assert check.output_problems(refusal, 2, "error: ... pip install 'ndparallel[plot]'") == []
    assert check.output_problems(refusal, 1, "Traceback") != []
