"""One vocabulary for run options (issue 48, item 1): an option is declared in few modules and
derived everywhere else, and the planner's request carries its ``Settings`` instead of declaring
their names again.

The count is of *copies*, over each module's syntax tree (``option_copies``): a module copies an
option when it declares a class field of that name (``name: T = ...``), passes it on under the same
name (``f(name=x.name)``, ``f(name=name)``: a field-by-field copy or pass-through), writes it as a
dict key (``{"name": ...}``, whatever the value), or holds the name or its flag (``"--name-x"``) as
a string. Reading an option to compute with it (``x = s.name``) is a use, not a copy, and is not
counted. ``accelerator/`` and ``axolotl/`` are not counted: they spell the peers' own API keywords
and YAML keys, which the front doors must read whatever our names are.

The target is ``TARGET`` modules under ``src/ndparallel``: the training config's field and its one
mapping to the runtime options (``config/``), the runtime option (``parallel/options.py``), the
planner's ``Settings`` field with its flag and config key (``plan/settings.py``), and the one place
that uses it. A new copy of any option fails here (raise a bound only with a reason).
"""

from __future__ import annotations

import ast
from dataclasses import fields, replace
from pathlib import Path

from ndparallel.parallel import options
from ndparallel.plan.search.evaluation import PER_LAYOUT, PlanRequest, base_settings
from ndparallel.plan.settings import Settings

SRC = Path(__file__).resolve().parents[1] / "src" / "ndparallel"
PEERS = ("accelerator/", "axolotl/")
"""The front doors of the peers (Accelerate's API, Axolotl's YAML): their keys are the peers'."""
TARGET = 4

BATCH_ARITHMETIC = {
    "seq_len": 7,  # the calibration's kernels and longest-sequence search, the equivalence tool
    "micro_batch": 5,  # the calibration's kernels and the plan CLI's checks
    "gpus_per_node": 5,  # simulate's command line and report
}
"""Not options but the batch arithmetic every layer computes with (``grad_accum`` and
``global_batch`` too, both at the target): a stated exception, not debt. 2026-12-06."""

REQUEST_ONLY = {
    "model",
    "hardware",
    "gpus",
    "gpus_per_node",
    "settings",
    "global_batch",
    "host_mem_bytes",
    "pipeline",
    "pipeline_schedule",
    "pipeline_virtual_stages",
}
"""``PlanRequest`` fields that are not one layout's settings: what to plan for and what to search."""

OPTION_CLASSES = (
    options.FSDPOptions,
    options.TPOptions,
    options.CPOptions,
    options.LossOptions,
    options.CompileOptions,
    options.Float8Options,
    options.QATOptions,
    options.PipelineOptions,
    Settings,
    PlanRequest,
)


def option_names() -> set[str]:
    """Every option field's name that is a compound word (single words such as ``enabled`` or
    ``plan`` are everyone's vocabulary and cannot be counted)."""
    return {f.name for cls in OPTION_CLASSES for f in fields(cls) if "_" in f.name}


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def module_copies(tree: ast.AST, names: set[str]) -> dict[str, list[str]]:
    """The copies in a module's ``tree`` of each option of ``names`` that it copies, by form (one
    walk of the tree): 'field' (a class-body declaration), 'keyword' (``f(name=x.name)`` /
    ``f(name=name)``), 'key' (a dict key) and 'string' (the name or its flag ``--name-x`` as a
    string constant)."""
    flags = {_flag(n): n for n in names}
    out: dict[str, list[str]] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            for st in node.body:
                target = st.target if isinstance(st, ast.AnnAssign) else None
                if isinstance(target, ast.Name) and target.id in names:
                    out.setdefault(target.id, []).append("field")
        elif isinstance(node, ast.keyword) and node.arg in names:
            value = node.value
            if (isinstance(value, ast.Name) and value.id == node.arg) or (
                isinstance(value, ast.Attribute) and value.attr == node.arg
            ):
                out.setdefault(node.arg, []).append("keyword")
        elif isinstance(node, ast.Dict):
            for k in node.keys:
                if isinstance(k, ast.Constant) and isinstance(k.value, str) and k.value in names:
                    out.setdefault(k.value, []).append("key")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            name = node.value if node.value in names else flags.get(node.value)
            if name is not None:
                out.setdefault(name, []).append("string")
    return out


def option_copies(tree: ast.AST, name: str) -> list[str]:
    """The copies of option ``name`` in a module's ``tree``, by form (``module_copies``)."""
    return module_copies(tree, {name}).get(name, [])


def copying_modules(names: set[str], trees: dict[str, ast.AST]) -> dict[str, list[str]]:
    """For each of ``names``, the modules (of ``trees``: path -> syntax tree) that copy it."""
    out: dict[str, list[str]] = {name: [] for name in names}
    for path in sorted(trees):
        for name in module_copies(trees[path], names):
            out[name].append(path)
    return out


def copy_modules(name: str, trees: dict[str, ast.AST]) -> list[str]:
    """The modules (of ``trees``: path -> syntax tree) that copy ``name``."""
    return copying_modules({name}, trees)[name]


def _trees() -> dict[str, ast.AST]:
    paths = (p for p in SRC.rglob("*.py") if not str(p.relative_to(SRC)).startswith(PEERS))
    return {str(p.relative_to(SRC)): ast.parse(p.read_text()) for p in paths}


def test_each_option_is_copied_in_few_modules():
    trees = _trees()
    bounds = BATCH_ARITHMETIC
    over, stale = [], []
    for name, where in sorted(copying_modules(option_names(), trees).items()):
        bound = bounds.get(name, TARGET)
        if len(where) > bound:
            over.append(f"{name}: {len(where)} modules > {bound} ({', '.join(where)})")
        if name in bounds and len(where) <= TARGET:
            stale.append(f"{name}: {len(where)} modules, at the target: remove its bound")
    assert over == [], "an option is copied in more modules than stated:\n" + "\n".join(over)
    assert stale == [], "\n".join(stale)
    assert not set(bounds) - option_names(), "a bound names no option field any more"


def test_the_copy_counter_finds_every_form_and_ignores_reads():
    """Negative control: each form of a copy is found, in no longer or shorter name, and a read
    (an attribute, a keyword under another name, a longer string) is not a copy."""
    sources = {
        "field.py": "class C:\n    tiled_mlp_num_shards: int = 1",
        "keyword.py": "f(tiled_mlp_num_shards=s.tiled_mlp_num_shards)\n"
        "g(tiled_mlp_num_shards=tiled_mlp_num_shards)",
        "key.py": "d = {'tiled_mlp_num_shards': 3}",
        "flag.py": "parser.add_argument('--tiled-mlp-num-shards')",
        "string.py": "getattr(s, 'tiled_mlp_num_shards')",
        "reads.py": "x = s.tiled_mlp_num_shards\nf(shards=s.tiled_mlp_num_shards)\n"
        "f(tiled_mlp_num_shards=4)\ny = 'tiled_mlp_num_shards_max'\ndef g(tiled_mlp_num_shards): pass",
        "shorter.py": "class C:\n    tiled_mlp: bool = False",
    }
    trees = {path: ast.parse(text) for path, text in sources.items()}
    assert option_copies(trees["keyword.py"], "tiled_mlp_num_shards") == ["keyword", "keyword"]
    assert copy_modules("tiled_mlp_num_shards", trees) == [
        "field.py",
        "flag.py",
        "key.py",
        "keyword.py",
        "string.py",
    ]
    assert copy_modules("tiled_mlp", trees) == ["shorter.py"]


def test_plan_request_carries_settings_not_their_names():
    """``PlanRequest`` declares no option of ``Settings`` again: its fields are what the request
    alone says, its ``settings``, and the search's per-layout choices (``PER_LAYOUT``)."""
    request = {f.name for f in fields(PlanRequest)}
    settings = {f.name for f in fields(Settings)}
    assert request - settings == REQUEST_ONLY
    assert request & settings == set(PER_LAYOUT)


def test_a_request_takes_each_option_by_its_name():
    from ndparallel.plan.hardware import get_preset
    from ndparallel.plan.models import PRESETS

    options = dict(
        seq_len=8192,
        mixed_precision="fp16",
        sequence_parallel=False,
        loss_parallel=False,
        cp_strategy="ulysses",
        loss_impl="full",
        loss_chunk_tokens=1024,
        lora_r=8,
        lora_saved=("embed",),
        tiled_mlp=True,
        tiled_mlp_num_shards=3,
        activation_offloading=True,
    )
    req = PlanRequest.of(PRESETS["llama-3.1-8b"], get_preset("h100-80gb"), 8, micro_batch=2, **options)
    assert {n: getattr(req.settings, n) for n in options} == options
    assert req.micro_batch == 2 and req.settings.micro_batch == 1  # the search's choice is the request's
    assert req.updated(seq_len=1024).settings == replace(req.settings, seq_len=1024)
    s = base_settings(req.updated(unsharded_grad_accumulation=True))
    assert s == replace(req.settings, unsharded_grad_accumulation=True)
    assert not base_settings(PlanRequest(req.model, req.hardware, 8)).unsharded_grad_accumulation  # auto: off
