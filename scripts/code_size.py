"""A report, not a rule: the longest modules and functions of ``src/ndparallel`` and, per option,
the modules that spell its name. Files are cut by concept (docs/architecture.md); this lists where
a reader may want a second look, and decides nothing.

``python scripts/code_size.py [--top N]``."""

from __future__ import annotations

import argparse
import ast
from collections import Counter
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "ndparallel"


def sizes() -> tuple[list[tuple[int, str]], list[tuple[int, str]]]:
    """(lines, module) of every module and (lines, module:line function) of every function."""
    files, functions = [], []
    for path in sorted(SRC.rglob("*.py")):
        text = path.read_text()
        rel = str(path.relative_to(SRC))
        files.append((text.count("\n"), rel))
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                functions.append((node.end_lineno - node.lineno + 1, f"{rel}:{node.lineno} {node.name}"))
    return sorted(files, reverse=True), sorted(functions, reverse=True)


def spellings() -> Counter:
    """How many modules name each ``Settings`` field (a string, an attribute, a keyword)."""
    from dataclasses import fields

    from ndparallel.plan.settings import Settings

    names = {f.name for f in fields(Settings) if "_" in f.name}
    count: Counter = Counter()
    for path in SRC.rglob("*.py"):
        tree = ast.parse(path.read_text())
        seen = {getattr(n, "attr", None) or getattr(n, "arg", None) for n in ast.walk(tree)}
        seen |= {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)}
        count.update(names & seen)
    return count


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--top", type=int, default=15)
    top = ap.parse_args().top
    files, functions = sizes()
    print(f"{len(files)} modules, {sum(n for n, _ in files):,} lines; the longest:")
    print("\n".join(f"  {n:5} {name}" for n, name in files[:top]))
    print("the longest functions:")
    print("\n".join(f"  {n:5} {name}" for n, name in functions[:top]))
    print("modules naming each planner setting:")
    print("\n".join(f"  {n:5} {name}" for name, n in spellings().most_common(top)))


if __name__ == "__main__":
    main()
