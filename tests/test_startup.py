"""``runtime/startup``: the model libraries are imported with the cyclic collector paused and, the
first time in a process, frozen; the collector is on again afterwards, also after a failed import;
the commands that build a model start with it once their input is known to be readable. (The time
it saves is measured by ``bench/startup_gc.py``, never here.)"""

from __future__ import annotations

import gc
import importlib
import subprocess
import sys
from types import SimpleNamespace

import pytest

from ndparallel.runtime import startup


def _recording(monkeypatch, states: list, fail: bool = False):
    def import_module(name):
        states.append((name, gc.isenabled()))
        if fail:
            raise ImportError(name)
        return importlib.import_module(name)

    monkeypatch.setattr(startup, "importlib", SimpleNamespace(import_module=import_module))


def test_imports_what_is_missing_with_the_collector_paused(monkeypatch):
    states = []
    _recording(monkeypatch, states)
    monkeypatch.setattr(startup, "MODEL_LIBRARIES", ("json", "colorsys"))
    monkeypatch.delitem(sys.modules, "colorsys", raising=False)
    frozen = gc.get_freeze_count()  # > 0: the test process froze its imports (conftest.py)
    startup.import_model_libraries()
    assert states == [("colorsys", False)] and gc.isenabled() and "colorsys" in sys.modules
    assert gc.get_freeze_count() == frozen  # not the first call in this process: nothing frozen
    startup.import_model_libraries()  # nothing missing: nothing imported
    assert states == [("colorsys", False)]


def test_a_failed_import_leaves_the_collector_on(monkeypatch):
    _recording(monkeypatch, [], fail=True)
    monkeypatch.setattr(startup, "MODEL_LIBRARIES", ("no_such_module_here",))
    with pytest.raises(ImportError):
        startup.import_model_libraries()
    assert gc.isenabled()


def test_commands_freeze_once_their_input_is_readable(tmp_path):
    """In a fresh process: `train -h`, a config with an unknown key, and `plan -h` freeze nothing
    and import no transformers (they fail or answer fast: our modules defer the heavy ones, see
    test_layout.START_UP); `export` of a missing checkpoint, past its argument checks, has imported
    the model libraries and frozen them."""
    code = (
        "import contextlib, gc, io, sys\nfrom ndparallel.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):\n"
        "    main(['train', '-h']); main(['train', '--set', 'no_such_key=1']); main(['plan', '-h'])\n"
        "    a = gc.get_freeze_count(), 'transformers' in sys.modules\n"
        f"    main(['export', {str(tmp_path / 'none')!r}, {str(tmp_path / 'out')!r}])\n"
        "    b = gc.get_freeze_count()\n"
        "print(*a, b, 'transformers.modeling_utils' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    before, early, after, loaded = (out.stdout.split() or ["?"] * 4)[-4:]
    assert before == "0" and early == "False", out.stdout + out.stderr
    assert after.isdigit() and int(after) > 100_000 and loaded == "True", out.stdout + out.stderr


def test_the_freeze_is_looked_up_once_per_process(monkeypatch):
    """``gc.get_freeze_count`` walks every frozen object (~0.07 s in a test process): asked once,
    not by every command a process runs (187 times in test_axolotl_examples.py)."""
    calls, real = [], gc.get_freeze_count
    monkeypatch.setattr(gc, "get_freeze_count", lambda: calls.append(1) or real())
    monkeypatch.setattr(startup, "_frozen", False)
    startup.import_model_libraries()
    startup.import_model_libraries()
    assert len(calls) == 1 and startup._frozen
