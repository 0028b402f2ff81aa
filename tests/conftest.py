"""Shared fixtures. ``torch`` and ``transformers`` are imported once per test process here
(``pytest_configure``) so that the forked ranks of ``ndparallel.testing.run_on_ranks`` start in
~0.1 s instead of re-importing them."""

import gc
import json
import os
import resource
import sys
import tempfile
from pathlib import Path

import pytest

# The suite runs on CPU/gloo ranks even on a machine with GPUs: an Accelerator built in a test (or
# a `ndparallel train` it starts) reads this instead of picking the visible GPUs.
os.environ["NDPARALLEL_DEVICE"] = "cpu"
# Trackers never reach a network here: a script that logs to W&B (Accelerate's nd_parallel.py does by
# default) writes an offline run into a scratch folder, as it would on a machine without an API key
# but with WANDB_MODE=offline.
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("WANDB_DIR", tempfile.mkdtemp(prefix="ndparallel-tests-wandb-"))
if os.environ.get("ATEN_CPU_CAPABILITY") and "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
    # Inductor's cache, warm from runs at the CPU's own capability, served kernels that computed
    # torchao's 8-bit AdamW update wrongly under ATEN_CPU_CAPABILITY=avx2 (losses 12 % off; right
    # with a cold cache, torch 2.13): a forced capability gets a cache of its own.
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(
        tempfile.gettempdir(), f"torchinductor-ndparallel-{os.environ['ATEN_CPU_CAPABILITY']}"
    )

if sys.flags.dont_write_bytecode:
    # PYTHONDONTWRITEBYTECODE (set on the development machines) left no .pyc of ndparallel or of
    # the tests: each test worker compiled ~230 modules and pytest rewrote every test module again
    # (~5 s of CPU), and so did every launcher and rank the suite starts (~0.3 s each). The test
    # processes write them again, as Python does by default (into the ignored __pycache__/
    # folders); the interpreters they start still write nothing, they read what is there.
    sys.dont_write_bytecode = False

_THREADS = None
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    # One of the suite's test workers (scripts/test.sh): the cores are shared out between them, so
    # that each worker's own torch ops (and the commands it runs, through OMP_NUM_THREADS) do not
    # oversubscribe them: OpenMP threads spinning for a busy core cost ~5 % of the suite's CPU. Set
    # before torch is imported: numpy's and scipy's OpenBLAS size their thread pools when loaded.
    _THREADS = max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))
    os.environ.setdefault("OMP_NUM_THREADS", str(_THREADS))
    os.environ.setdefault("OPENBLAS_NUM_THREADS", str(_THREADS))

from ndparallel.runtime.quiet import quiet_library_noise  # noqa: E402 - logging and re only

quiet_library_noise()  # as every ndparallel process: no torchao / pytree lines in the suite's log


def _import_what_ranks_import() -> None:
    """Import here, once per test process, what the suite's forked ranks import
    (``tests/rank_modules.txt``, recorded by ``tests/scripts/record_rank_modules.py``): a rank
    inherits the modules of the process it is forked from and imports the rest itself — ~2,000
    modules, ~1.8 s of CPU for every rank of every test otherwise. A module that cannot be
    imported here (another version, another platform) is left to the ranks."""
    import importlib
    import warnings

    listing = Path(__file__).with_name("rank_modules.txt")
    names = listing.read_text().split() if listing.is_file() else []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in names:
            if name not in sys.modules:
                try:
                    importlib.import_module(name)
                except Exception:  # noqa: BLE001 - a cache: what fails here is imported by the ranks
                    pass


_COLLECTING_ONLY = any(a in ("--collect-only", "--co") for a in sys.argv)
"""``pytest --collect-only`` (gpu_all's smoke asks twice) forks no rank: the ranks' modules are not
imported for it (~20 % of such a process's CPU)."""


def _is_xdist_controller(config) -> bool:
    """pytest-xdist's controller (``-n N``): it hands test files to the workers and runs none."""
    return not hasattr(config, "workerinput") and bool(getattr(config.option, "numprocesses", None))


def _prepare_test_process() -> None:
    """torch, transformers and what the forked ranks import, once per process that runs tests (not
    xdist's controller: ~6 s of CPU before any worker started), then the counted comparison."""
    import torch
    import transformers  # noqa: F401

    from ndparallel.runtime.startup import import_model_libraries, paused_collector

    if _THREADS is not None:
        torch.set_num_threads(_THREADS)
    with paused_collector():  # as ndparallel's commands import (runtime/startup.py): ~20 % less time
        if not _COLLECTING_ONLY:
            _import_what_ranks_import()
        gc.freeze()  # the imported modules' objects leave every later collection, here and in forked ranks
    if not _COLLECTING_ONLY:
        import_model_libraries()  # all imported: it only notes the freeze, for every command and forked rank

    import ndparallel.tools.agreement  # noqa: F401 - binds the uncounted compare first
    from ndparallel.tools import equivalence

    _COMPARE.compare = equivalence.compare
    equivalence.compare = _COMPARE


class _CountedCompare:
    """``tools.equivalence.compare`` as the tests see it (installed before any test module binds
    the name): the same function, each call counted for the suite's summary line — the number of
    layout-vs-one-process comparisons made must not fall (docs/testing.md). The noise-floor
    measurement of ``tools.agreement`` (a reference against itself) is not counted."""

    def __init__(self):
        self.compare, self.calls = None, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.compare(*args, **kwargs)


_COMPARE = _CountedCompare()


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config):
    if not _is_xdist_controller(config):
        _prepare_test_process()
    elif getattr(config.option, "loadscopereorder", False):
        # pytest-xdist >= 3.6 hands out files (--dist loadfile) by their number of tests unless
        # told not to: the longest files (6-7 tests each) started halfway through the suite.
        config.option.loadscopereorder = False  # the order pytest_collection_modifyitems gives


@pytest.fixture(autouse=True)
def _no_process_group_left_in_pytest():
    """A test that starts a process group in the pytest process itself must destroy it: the forked
    ranks of later tests would inherit it without its threads (a crash or a hang there)."""
    yield
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
        pytest.fail("the test left a default process group in the pytest process")


DURATIONS = Path(__file__).with_name("durations.json")
UNLISTED_FILE_S = 10.0
"""A test file tests/durations.json does not list yet counts as this many seconds."""


def file_weight(name: str, weights: dict) -> float:
    return weights.get(name, UNLISTED_FILE_S)


def order_by_file_weight(items: list, file_of, weights: dict) -> list:
    """Longest files first, each file's tests together and in their own order (a stable sort)."""
    return sorted(items, key=lambda item: -file_weight(file_of(item), weights))


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    """The suite's test workers (``scripts/test.sh``: pytest-xdist, one file at a time per worker)
    take the longest files first and fill in with the short ones, so no long file starts last.
    The seconds per file are measured (``tests/durations.json``, refreshed by
    ``tests/tools/suite_time.py --write-durations``); a stale file changes the order, nothing else."""
    try:
        weights = json.loads(DURATIONS.read_text())
    except (OSError, ValueError):
        return
    items[:] = order_by_file_weight(items, lambda item: item.path.name, weights)


def pytest_sessionfinish(session):
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:  # a test worker: its count goes to the controller
        workeroutput["equivalence_comparisons"] = _COMPARE.calls


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook: the controller hears each worker end
def pytest_testnodedown(node, error):
    node.config._ndparallel_comparisons = getattr(
        node.config, "_ndparallel_comparisons", 0
    ) + node.workeroutput.get("equivalence_comparisons", 0)


def pytest_terminal_summary(terminalreporter, config):
    count = getattr(config, "_ndparallel_comparisons", 0) + _COMPARE.calls
    terminalreporter.write_line(
        f"equivalence comparisons (a layout's run against one process's, tools.equivalence.compare): {count}"
    )


def _cpu_seconds() -> float:
    """User + system CPU of this process and of its children that were waited for."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    item.stash[_CPU_AT_START] = _cpu_seconds()
    return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """Each test's CPU seconds (itself, its fixtures, the ranks and commands it waited for) go into
    the JUnit report as the property ``cpu_s`` (with its teardown): ``tests/tools/suite_time.py`` sums
    them per file."""
    if call.when == "teardown" and _CPU_AT_START in item.stash:
        item.user_properties.append(("cpu_s", round(_cpu_seconds() - item.stash[_CPU_AT_START], 2)))
    return (yield)


_CPU_AT_START = pytest.StashKey[float]()
