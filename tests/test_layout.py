"""The code's architecture stays visible: folders are layers, no import cycles, small files and
functions, and lower layers never import higher ones. Static checks (AST only, nothing imported)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "ndparallel"
MAX_TOP_LEVEL_MODULES = 8
MAX_FILE_LINES = 450
MAX_FUNCTION_LINES = 80

# Each folder may import only from the folders listed before it (and itself); ``accelerator`` is
# the facade over the layers below it. ``parallelism_config`` and ``utils`` are the top-level
# modules that mirror Accelerate's import paths (``accelerate.parallelism_config``,
# ``accelerate.utils``); they are listed so their imports are checked like any layer's.
# (``testing`` only re-exports the runtime's multi-rank runner.)
LAYERS = ["layout", "parallelism_config", "runtime", "tracking", "models", "parallel", "data", "checkpoint", "plan",
          "accelerator", "utils", "training", "tools", "cli"]


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _imports(path: Path, name: str, modules: dict[str, Path]) -> set[str]:
    """ndparallel modules ``name`` imports anywhere in its file (function-level imports included)."""
    tree = ast.parse(path.read_text())
    is_pkg = path.name == "__init__.py"
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = name.split(".") if is_pkg else name.split(".")[:-1]
                pkg = pkg[: len(pkg) - node.level + 1]
                base = ".".join(pkg + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in modules:
                t = t.rpartition(".")[0]
            if t.startswith("ndparallel") and t != name:
                found.add(t)
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(path, name, modules) for name, path in modules.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def _layer(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def test_no_import_cycles():
    graph = {m: {d for d in deps if d != "ndparallel"} for m, deps in _graph().items()}
    assert _cycles(graph) == []


def test_lower_layers_never_import_higher_ones():
    bad = []
    for module, deps in _graph().items():
        src = _layer(module)
        if src not in LAYERS:
            continue
        for dep in deps:
            dst = _layer(dep)
            if dst in LAYERS and LAYERS.index(dst) > LAYERS.index(src):
                bad.append(f"{module} -> {dep}")
    assert bad == []


def test_few_modules_at_the_top():
    top = [p.name for p in PACKAGE.glob("*.py") if p.name not in ("__init__.py", "__main__.py")]
    assert len(top) <= MAX_TOP_LEVEL_MODULES, top


def test_files_and_functions_are_small():
    long_files, long_functions = [], []
    for path in PACKAGE.rglob("*.py"):
        text = path.read_text()
        rel = path.relative_to(PACKAGE)
        if text.count("\n") > MAX_FILE_LINES:
            long_files.append(f"{rel}: {text.count(chr(10))} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    long_functions.append(f"{rel}:{node.lineno} {node.name}: {n} lines")
    assert long_files == [] and long_functions == []


def test_the_checker_finds_a_cycle():
    """Negative control: the cycle finder is not vacuous."""
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
