"""``runtime/startup.import_model_libraries``: the model libraries are imported with the cyclic
collector paused, then frozen; the collector is on again afterwards; a second call does nothing.
(The time it saves is measured by ``bench/startup_gc.py``, never here.)"""

from __future__ import annotations

import gc
import importlib
import sys
from types import SimpleNamespace

from ndparallel.runtime import startup


def test_imports_with_the_collector_paused_then_freezes(monkeypatch):
    states = []

    def import_module(name):
        states.append((name, gc.isenabled()))
        return importlib.import_module(name)

    monkeypatch.setattr(startup, "MODEL_LIBRARIES", ("colorsys",))
    monkeypatch.setattr(startup, "importlib", SimpleNamespace(import_module=import_module))
    monkeypatch.delitem(sys.modules, "colorsys", raising=False)
    frozen = gc.get_freeze_count()
    startup.import_model_libraries()
    assert states == [("colorsys", False)] and gc.isenabled() and "colorsys" in sys.modules
    assert gc.get_freeze_count() > frozen
    startup.import_model_libraries()  # imported already: nothing imported, nothing frozen
    assert states == [("colorsys", False)]


def test_a_failed_import_leaves_the_collector_on(monkeypatch):
    def import_module(name):
        raise ImportError(name)

    monkeypatch.setattr(startup, "MODEL_LIBRARIES", ("no_such_module_here",))
    monkeypatch.setattr(startup, "importlib", SimpleNamespace(import_module=import_module))
    try:
        startup.import_model_libraries()
    except ImportError:
        pass
    assert gc.isenabled()


def test_commands_that_build_a_model_start_with_it():
    """In a fresh process: `train -h` and `plan` leave the heap unfrozen; `export` (bad arguments
    and all) starts with the frozen import."""
    import subprocess

    code = ("import contextlib, gc, io\nfrom ndparallel.cli import main\n"
            "with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):\n"
            "    main(['train', '-h']); main(['plan', '-h']); a = gc.get_freeze_count()\n"
            "    main(['export', '--no-such-flag']); b = gc.get_freeze_count()\n"
            "print(a, b)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    before, after = map(int, out.stdout.split()[-2:])
    assert before == 0 and after > 100_000, out.stdout + out.stderr
