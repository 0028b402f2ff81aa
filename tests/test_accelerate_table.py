"""docs/accelerate.md's API table cannot go stale: every public name of the installed
Accelerate's ``Accelerator`` and ``ParallelismConfig`` (and every constructor argument) has a row,
and every name marked supported / differs exists on ours."""

import ast
import inspect
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
STATES = {"supported", "differs", "not supported"}


def _table() -> dict[str, str]:
    text = (ROOT / "docs" / "accelerate.md").read_text()
    section = text.split("## API table: supported / differs / not supported", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        m = re.match(r"\| (`[^|]+`) \| ([a-z ]+) \|", line)  # one name, or several sharing a state
        if m:
            for name in re.findall(r"`([^`]+)`", m.group(1)):
                rows[name] = m.group(2).strip()
    return rows


def _public(cls) -> list[str]:
    return [n for n in dir(cls) if not n.startswith("_")]


def _accelerate_names() -> list[str]:
    accelerate = pytest.importorskip("accelerate")
    from accelerate.parallelism_config import ParallelismConfig

    args = list(inspect.signature(accelerate.Accelerator.__init__).parameters)[1:]
    return (
        [f"Accelerator({a}=)" for a in args]
        + [f"Accelerator.{n}" for n in _public(accelerate.Accelerator)]
        + [f"ParallelismConfig.{n}" for n in _public(ParallelismConfig)]
    )


def test_every_public_accelerate_name_has_a_row():
    rows = _table()
    missing = [n for n in _accelerate_names() if n not in rows]
    assert missing == [], f"add these to docs/accelerate.md's API table: {missing}"
    assert set(rows.values()) <= STATES, set(rows.values()) - STATES


def _instance_attributes() -> set[str]:
    """Attributes the Accelerator sets in ``__init__`` (``self.x = ...``)."""
    tree = ast.parse((ROOT / "src/ndparallel/accelerator/core.py").read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                for el in t.elts if isinstance(t, ast.Tuple) else [t]:
                    if (
                        isinstance(el, ast.Attribute)
                        and isinstance(el.value, ast.Name)
                        and el.value.id == "self"
                    ):
                        names.add(el.attr)
    return names


def test_names_marked_supported_or_differs_exist_on_ours():
    from ndparallel import Accelerator, ParallelismConfig

    ours_args = set(inspect.signature(Accelerator.__init__).parameters)
    attrs = _instance_attributes()
    pc = ParallelismConfig()
    absent = []
    for name, state in _table().items():
        if state == "not supported":
            continue
        if name.startswith("Accelerator("):
            ok = name[len("Accelerator(") : -2] in ours_args
        elif name.startswith("Accelerator."):
            attr = name.split(".", 1)[1]
            ok = hasattr(Accelerator, attr) or attr in attrs
        else:
            ok = hasattr(pc, name.split(".", 1)[1])
        if not ok:
            absent.append(name)
    assert absent == []


def test_the_table_check_can_fail():
    """Negative control: a name that is not in the table is reported; a grouped row counts each name."""
    rows = _table()
    assert "Accelerator.no_such_method" not in rows
    assert rows["Accelerator.autocast"] == rows["Accelerator.wait_for_everyone"] == "supported"
