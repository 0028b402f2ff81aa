"""The code's architecture stays visible: folders are layers, no import cycles, and lower layers
never import higher ones. Static checks (AST only, nothing imported). How long modules and
functions are is a report, not a rule (``scripts/code_size.py``): files are cut by concept."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "ndparallel"
MAX_TOP_LEVEL_MODULES = 8

# Each folder may import only from the folders listed before it (and itself). Bottom up: the layout
# and the runtime; optimizers and trackers; models, the training techniques that are no parallel
# dimension, the parallel dimensions, data, checkpoints and the planner; the engine over them; the
# typed run config; the trainer's loop; the checks before launch; the front doors (``axolotl``:
# YAML with Axolotl's keys; ``accelerator``: Accelerate's Python surface; ``transformers`` / ``trl``:
# the Trainer door, an adapter over ``accelerator``); tools and the CLI on top.
# ``parallelism_config`` and ``utils`` are the top-level modules that mirror
# Accelerate's import paths (``accelerate.parallelism_config``, ``accelerate.utils``); they are listed
# so their imports are checked like any layer's. (``testing`` only re-exports the runtime's runner.)
LAYERS = [
    "layout",
    "parallelism_config",
    "runtime",
    "optim",
    "tracking",
    "models",
    "techniques",
    "parallel",
    "data",
    "checkpoint",
    "plan",
    "engine",
    "config",
    "training",
    "preflight",
    "axolotl",
    "accelerator",
    "transformers",
    "trl",
    "utils",
    "tools",
    "cli",
]
FRONT_DOORS = ("axolotl", "accelerator", "transformers", "trl")
"""Side by side: none imports another (only ``tools`` and ``cli``, above them, use them), except
the Trainer door, an adapter over the Accelerate facade (``DOOR_OVER_DOOR``)."""
DOOR_OVER_DOOR = {("transformers", "accelerator"), ("trl", "transformers"), ("trl", "accelerator")}


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


def _arrows_up(graph: dict[str, set[str]]) -> list[str]:
    """Imports from a layer of ``LAYERS`` into a higher one (``a -> b``)."""
    bad = []
    for module, deps in graph.items():
        src = _layer(module)
        if src not in LAYERS:
            continue
        for dep in deps:
            dst = _layer(dep)
            if dst in LAYERS and LAYERS.index(dst) > LAYERS.index(src):
                bad.append(f"{module} -> {dep}")
    return sorted(bad)


def test_lower_layers_never_import_higher_ones():
    assert _arrows_up(_graph()) == []


def test_the_layer_checker_finds_an_arrow_up():
    """Negative control: the engine importing the trainer, or the typed config the YAML front door's
    key table, is an arrow running back up; the trainer importing the engine is not."""
    graph = {
        "ndparallel.engine.step": {"ndparallel.training.trainer", "ndparallel.techniques.loss"},
        "ndparallel.config.errors": {"ndparallel.axolotl.keys"},
        "ndparallel.training.trainer": {"ndparallel.engine.step", "ndparallel.config.schema"},
    }
    assert _arrows_up(graph) == [
        "ndparallel.config.errors -> ndparallel.axolotl.keys",
        "ndparallel.engine.step -> ndparallel.training.trainer",
    ]


def test_the_front_doors_stand_side_by_side():
    bad = [
        f"{module} -> {dep}"
        for module, deps in _graph().items()
        for dep in deps
        if _layer(module) in FRONT_DOORS
        and _layer(dep) in FRONT_DOORS
        and _layer(dep) != _layer(module)
        and (_layer(module), _layer(dep)) not in DOOR_OVER_DOOR
    ]
    assert bad == []


def test_few_modules_at_the_top():
    top = [p.name for p in PACKAGE.glob("*.py") if p.name not in ("__init__.py", "__main__.py")]
    assert len(top) <= MAX_TOP_LEVEL_MODULES, top


def _names_used_twice(paths) -> dict[str, list[str]]:
    """File names (``__init__`` and ``__main__`` aside) that more than one module of ours has."""
    by_name: dict[str, list[str]] = {}
    for path in paths:
        if path.stem not in ("__init__", "__main__"):
            by_name.setdefault(path.stem, []).append(str(path.relative_to(PACKAGE)))
    return {name: sorted(where) for name, where in by_name.items() if len(where) > 1}


def test_no_module_name_used_twice():
    """A module's name says which one it is: ``pipeline`` or ``build`` in two folders reads the same
    in a traceback, an import line or a conversation."""
    assert _names_used_twice(PACKAGE.rglob("*.py")) == {}


def test_the_name_checker_finds_a_repeat():
    """Negative control."""
    paths = [
        PACKAGE / "data" / "pipeline.py",
        PACKAGE / "plan" / "pipeline.py",
        PACKAGE / "plan" / "__init__.py",
    ]
    assert _names_used_twice(paths) == {"pipeline": ["data/pipeline.py", "plan/pipeline.py"]}


def test_the_checker_finds_a_cycle():
    """Negative control: the cycle finder is not vacuous."""
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


# ------------------------------------------------------------- one engine, two front doors
ENGINE_USERS = (
    "layout",
    "runtime",
    "models",
    "techniques",
    "parallel",
    "data",
    "checkpoint",
    "plan",
    "engine",
    "config",
    "training",
    "preflight",
    "axolotl",
    "tools",
)
"""Folders that run training through the engine, never through the Accelerate facade."""
FACADE_STATE = ("_models", "_optimizers", "_schedulers", "_prepared_optimizers", "_dataloaders")


def _facade_uses(path: Path) -> list[str]:
    """Calls of ``prepare``/``prepare_model`` and reads of the facade's tracked lists (attribute or
    ``getattr`` string) in one file."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and node.attr in FACADE_STATE:
            found.append(f"{node.lineno}: .{node.attr}")
        elif isinstance(node, ast.Call):
            fn = node.func
            if isinstance(fn, ast.Attribute) and fn.attr in ("prepare", "prepare_model"):
                found.append(f"{node.lineno}: .{fn.attr}(...)")
            if (
                isinstance(fn, ast.Name)
                and fn.id == "getattr"
                and len(node.args) > 1
                and isinstance(node.args[1], ast.Constant)
                and node.args[1].value in FACADE_STATE
            ):
                found.append(f"{node.lineno}: getattr(..., {node.args[1].value!r})")
    return found


def test_engine_users_never_reach_into_the_facade():
    bad = []
    for module, deps in _graph().items():
        if _layer(module) in ENGINE_USERS:
            bad += [f"{module} imports {d}" for d in deps if _layer(d) == "accelerator"]
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE)
        if rel.parts[0] in ENGINE_USERS:
            bad += [f"{rel}:{use}" for use in _facade_uses(path)]
    assert bad == []


def test_the_facade_checker_finds_a_use(tmp_path):
    """Negative control: a module that reads ``acc._models`` and calls ``acc.prepare_model`` is found."""
    f = tmp_path / "m.py"
    f.write_text(
        "def f(acc, m):\n    acc.prepare_model(m)\n    return getattr(acc, '_schedulers'), acc._models\n"
    )
    assert len(_facade_uses(f)) == 3


# ------------------------------------------------------------- Axolotl's names stay at its door
BELOW_THE_FRONT_DOORS = LAYERS[: LAYERS.index("axolotl")]
SHARED_WORDS = {
    "model_type",
    "revision",
    "world_size",
    "peft",
    "quantization",
    "device_map",
    "tokenizer_config",
    "shards",
    "rope_scaling",
    "pad_to_multiple_of",
    "temperature",
    "gradient_checkpointing",
    "flex_attention",
    "float16",
    "bfloat16",
    "float32",
    "fsdp",
    "ddp",
    "deepspeed",
    "local_rank",
    "batch_size",
    "streaming",
    "version",
    "gradient_checkpointing_kwargs",
    "model_config",
    "field",
    "strict",
    "text_column",
    "trl",  # the package (and the extra that installs it: runtime/extras.py)
}
"""Axolotl keys that are also Python's, pydantic's, torch's, transformers', PEFT's or Accelerate's own
words (a dtype, a config attribute, a backend, an argument): meeting one below the front doors says
nothing about Axolotl."""


def _axolotl_names() -> set[str]:
    """Axolotl's keys that the typed config does not hold under the same name (``axolotl/keys.py``'s
    tables), less the shared words."""
    from ndparallel.axolotl import keys
    from ndparallel.config.datasets import DatasetConfig
    from ndparallel.config.fields import FSDPConfig
    from ndparallel.config.schema import TrainConfig

    ours = {n for model in (TrainConfig, FSDPConfig, DatasetConfig) for n in model.model_fields}
    return (set(keys.TOP) | set(keys.DATASET) | set(keys.FSDP)) - ours - SHARED_WORDS


def _names_used(path: Path, names: set[str]) -> list[str]:
    """``names`` met in one file's code: words of a string (docstrings aside), an attribute, a
    keyword argument or a variable."""
    import re

    tree = ast.parse(path.read_text())
    docstrings = {
        id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant)
    }
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            words = set(re.findall(r"[A-Za-z_]\w*", node.value))
        else:
            words = {getattr(node, "attr", None) or getattr(node, "arg", None) or getattr(node, "id", None)}
        found += [f"{node.lineno}: {w}" for w in sorted(words & names)]
    return found


def test_no_axolotl_key_below_the_front_doors():
    """Axolotl's key tables and their translation live in ``axolotl/``: nothing below the front doors
    reads, writes or names a key of those tables (the typed config has its own names)."""
    names = _axolotl_names()
    assert {"torch_compile", "dataset_prepared_path", "sequence_parallel_degree"} <= names  # not vacuous
    bad = []
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE)
        if (rel.parts[0] if len(rel.parts) > 1 else rel.stem) in BELOW_THE_FRONT_DOORS:
            bad += [f"{rel}:{use}" for use in _names_used(path, names)]
    assert bad == []


def test_the_axolotl_name_finder_finds_one(tmp_path):
    """Negative control: a string, an attribute and a keyword naming Axolotl keys are found; the same
    words in a docstring, and the typed config's own names, are not."""
    f = tmp_path / "m.py"
    f.write_text(
        '"""torch_compile in a docstring."""\n'
        'def f(cfg):\n    """dataset_prepared_path too."""\n'
        '    return cfg.sequence_parallel_degree, g(ddp_timeout=1), "set torch_compile: true", cfg.compile\n'
    )
    assert sorted(_names_used(f, _axolotl_names())) == [
        "4: ddp_timeout",
        "4: sequence_parallel_degree",
        "4: torch_compile",
    ]


# ------------------------------------------------------------- lazy imports
HEAVY_PACKAGES = {
    "torch",
    "transformers",
    "datasets",
    "tokenizers",
    "safetensors",
    "huggingface_hub",
    "numpy",
    "peft",
    "torchao",
    "accelerate",
    "matplotlib",
}
"""Third-party packages that take seconds to import or are optional extras: the only imports a
function may make in its body (docs/development.md). Our own modules are imported at module level,
except as ``START_UP`` says."""
START_UP = {
    "ndparallel": "``Accelerator`` on first access: ``import ndparallel`` stays light",
    "ndparallel.cli": "the command's module after its arguments are read",
    "ndparallel.cli.commands": "a command's machinery once its config is known to be good",
    "ndparallel.cli.export_command": "the export machinery after the arguments are checked",
    "ndparallel.cli.launch_check": "the pre-launch checks of `launch ... train CFG` only",
    "ndparallel.cli.plan_config": "the planner only for `plan --config`",
    "ndparallel.cli.simulate_command": "the simulation machinery after the arguments are checked",
    "ndparallel.config.datasets": "the data code only where a datasets entry is validated",
    "ndparallel.config.fields": "the model presets only where a preset is named",
    "ndparallel.config.quant": "the QAT / quantisation code only where those fields are set",
    "ndparallel.config.schema": "the strategy options only where a run's options are built",
    "ndparallel.layout.config": "the mesh code only where a mesh is built",
    "ndparallel.models.flops": "the model code only where a real model's MoE weights are counted",
    "ndparallel.plan.adapters.qlora": "the NF4 code only where a 4-bit base is costed",
    "ndparallel.optim": "``build_optimizer`` on first access: a config's optimizer name imports no torch",
    "ndparallel.optim.names": "Muon's note only where Muon is named",
    "ndparallel.optim.build": "Muon and torchao's optimizers only where chosen",
    "ndparallel.optim.lowbit": "torchao's optimizers only where chosen",
    "ndparallel.checkpoint.export": "the model code only where a checkpoint is exported",
    "ndparallel.plan.cli.main": "the runtime's refusals and the model loader only where used",
    "ndparallel.plan.time.comms": "torch's mesh code only where a profile is compared",
    "ndparallel.plan.time.gemm": "torch only where a GEMM is timed",
    "ndparallel.plan.time.membound": "torch only where a kernel is timed",
    "ndparallel.plan.memory.peak": "the runtime's layer code only where a real model is measured",
    "ndparallel.plan.models": "transformers' configs only where a model is read",
    "ndparallel.preflight.checks": "each check's machinery when it runs (a bad config is refused first)",
    "ndparallel.preflight.pipeline_check": "the pipeline code only with pipeline_parallel_size > 1",
    "ndparallel.preflight.plan_text": "the data and model code only for `--dry-run`",
    "ndparallel.runtime.multirank": "a forked rank imports the runtime after its environment is set",
}
"""Modules on the command line's start-up path (what `ndparallel train|plan|... -h` and a refused
config import): a function there may import one of our *heavy* modules (one reaching a
``HEAVY_PACKAGES`` package at module level), so a bad config is refused in about a second
(``tests/test_startup.py``). Each entry says what it defers."""


def _module_level_imports(tree: ast.Module) -> list[ast.stmt]:
    out = []
    for node in tree.body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            out.append(node)
        elif isinstance(node, ast.Try):
            out += [n for n in node.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    return out


def _targets(node, name: str, path: Path, modules: dict[str, Path]) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    base = node.module or ""
    if node.level:
        pkg = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        base = ".".join(pkg[: len(pkg) - node.level + 1] + ([base] if base else []))
    return [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]


def _heavy_modules() -> set[str]:
    """Our modules whose module-level imports (their packages' ``__init__`` included) reach a
    ``HEAVY_PACKAGES`` package."""
    modules = _modules()
    deps, heavy = {}, set()
    for name, path in modules.items():
        found = set()
        for node in _module_level_imports(ast.parse(path.read_text())):
            for target in _targets(node, name, path, modules):
                if target.split(".")[0] in HEAVY_PACKAGES:
                    heavy.add(name)
                found.add(target)
        parts = name.split(".")
        found |= {".".join(parts[:i]) for i in range(1, len(parts))}
        deps[name] = {d for d in found if d in modules and d != name}
    changed = True
    while changed:
        grown = {n for n, ds in deps.items() if n not in heavy and ds & heavy}
        heavy |= grown
        changed = bool(grown)
    return heavy


def _local_imports(path: Path, name: str, modules: dict[str, Path]) -> list[tuple[int, str]]:
    """(line, module) of every import of ours inside a function of ``path``."""
    found = []
    for fn in ast.walk(ast.parse(path.read_text())):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for node in ast.walk(fn):
                if isinstance(node, (ast.Import, ast.ImportFrom)):
                    for target in _targets(node, name, path, modules):
                        if target.split(".")[0] == "ndparallel":
                            found.append((node.lineno, target))
    return sorted(set(found))


def _lazy_import_problems(modules: dict[str, Path], heavy: set[str]) -> list[str]:
    bad = []
    for name, path in modules.items():
        for line, target in _local_imports(path, name, modules):
            if name not in START_UP:
                bad.append(f"{name}:{line} imports {target} in a function: import it at module level")
            elif target not in heavy:
                bad.append(f"{name}:{line} defers {target}, which is light: import it at module level")
    return sorted(bad)


def test_our_modules_are_imported_at_module_level():
    """A function imports one of our modules only on the start-up path and only a heavy one; every
    other import of ours is at the top of its file (no import cycle needs one: the test above)."""
    modules = _modules()
    heavy = _heavy_modules()
    assert {"ndparallel.engine.engine", "ndparallel.preflight.model_check"} <= heavy  # not vacuous
    assert "ndparallel.runtime.quiet" not in heavy
    assert _lazy_import_problems(modules, heavy) == []


def test_the_lazy_import_checker_finds_one(tmp_path):
    """Negative control: a function importing one of our modules outside the start-up path is found,
    and so is one deferring a light module on it."""
    pkg = tmp_path / "ndparallel"
    (pkg / "engine").mkdir(parents=True)
    (pkg / "engine" / "x.py").write_text("def f():\n    from ndparallel.config.errors import ConfigError\n")
    (pkg / "cli").mkdir()
    (pkg / "cli" / "__init__.py").write_text("def g():\n    from ndparallel.config import errors\n")
    modules = {"ndparallel.engine.x": pkg / "engine" / "x.py", "ndparallel.cli": pkg / "cli" / "__init__.py"}
    modules["ndparallel.config.errors"] = PACKAGE / "config" / "errors.py"
    assert _lazy_import_problems(modules, heavy=set()) == [
        "ndparallel.cli:2 defers ndparallel.config.errors, which is light: import it at module level",
        "ndparallel.engine.x:2 imports ndparallel.config.errors in a function: import it at module level",
    ]
