"""Whose line is it: a command's output split into the lines ndparallel wrote and the rest (a
library's warning or log record, a C++ message from torch or gloo, a traceback), so a test can
fail on any line the user did not ask for without a list of known messages.

``recorded_output(tmp)`` sends file descriptors 1 and 2 of this process, of the ranks it forks
and of the interpreters they start to one file, and replaces ``sys.stdout`` / ``sys.stderr``
with a writer that also notes each complete line whose writer is ndparallel: the nearest caller,
past the standard library's output machinery (io, logging, warnings) and rich, whose module is
``ndparallel.*``. A library's ``warnings.warn`` or logging call, a handler holding the original
stream, C++ code writing to the descriptor and the interpreter's traceback are therefore not
noted, whatever they say. Child interpreters note theirs through ``origin_site/sitecustomize.py``
(put on their ``PYTHONPATH``); ``ORIGIN_ENV`` names the file of noted lines.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import sys
import tempfile
import warnings
from dataclasses import dataclass, field
from pathlib import Path

ORIGIN_ENV = "NDPARALLEL_TEST_OWN_LINES"
SITE = Path(__file__).resolve().parent / "origin_site"
MACHINERY = ("io", "_io", "codecs", "logging", "warnings", "traceback", "contextlib", "rich", "output_origin")
"""Modules that only carry text to the stream: the writer is whoever called them."""


def _writer(frame) -> str:
    """The module name of the nearest caller outside ``MACHINERY`` (a ``-m`` module's own name)."""
    while frame is not None:
        g = frame.f_globals
        name = g.get("__name__", "")
        if name == "__main__" and g.get("__spec__") is not None:
            name = g["__spec__"].name
        if name.split(".")[0] not in MACHINERY:
            return name
        frame = frame.f_back
    return ""


class _Noting(io.TextIOBase):
    """``stream`` (a text stream) that appends each complete line ndparallel writes to ``own``."""

    def __init__(self, stream, own: str):
        self._stream, self._own, self._line, self._ours = stream, own, "", None

    def write(self, text: str) -> int:
        if self._ours is None and text:
            self._ours = _writer(sys._getframe(1)).split(".")[0] == "ndparallel"
        self._line += text
        while "\n" in self._line:
            line, self._line = self._line.split("\n", 1)
            self._stream.write(line + "\n")
            self._stream.flush()
            if self._ours:
                fd = os.open(self._own, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
                os.write(fd, (line + "\n").encode())
                os.close(fd)
            self._ours = None if not self._line else self._ours
        return len(text)

    def flush(self) -> None:
        self._stream.flush()

    def fileno(self) -> int:
        return self._stream.fileno()

    def isatty(self) -> bool:
        return False

    @property
    def encoding(self):
        return self._stream.encoding


def note_own_lines(own: str) -> None:
    """Wrap this process's ``sys.stdout`` and ``sys.stderr`` (a child interpreter's site hook)."""
    sys.stdout, sys.stderr = _Noting(sys.stdout, own), _Noting(sys.stderr, own)


@dataclass
class Output:
    stdout: str = ""
    stderr: str = ""
    own: list[str] = field(default_factory=list)

    def foreign(self) -> list[str]:
        """The lines nobody in ndparallel wrote (blank ones aside)."""
        own = set(self.own)
        lines = self.stdout.splitlines() + self.stderr.splitlines()
        return [line for line in lines if line.strip() and line not in own]


PYTHON_DEFAULT_FILTERS = [
    ("default", DeprecationWarning, "__main__"),
    ("ignore", DeprecationWarning, ""),
    ("ignore", PendingDeprecationWarning, ""),
    ("ignore", ImportWarning, ""),
    ("ignore", ResourceWarning, ""),
]
"""The warning filters of a plain ``python`` (no -W, no dev mode), in order."""


def _show(message, category, filename, lineno, file=None, line=None):
    """Python's own display of a warning, on ``sys.stderr`` as it is now."""
    sys.stderr.write(warnings.formatwarning(message, category, filename, lineno, line))


@contextlib.contextmanager
def _shown_as_outside_pytest():
    """pytest records warnings and log records instead of showing them, and a logging handler made
    while it captured holds its capture file: for the block, warnings are shown as by a plain
    ``python``, records with no handler of their own reach ``stderr`` (logging's last resort), and
    handlers holding another stream than descriptor 1 or 2 write to descriptor 2."""
    root = logging.getLogger()
    named = logging.Logger.manager.loggerDict.values()
    loggers = [root, *(x for x in named if isinstance(x, logging.Logger))]
    moved = [
        (h, h.stream)
        for lg in loggers
        for h in lg.handlers
        if type(h) is logging.StreamHandler and _fd(h.stream) not in (1, 2)
    ]
    pytest_handlers, root.handlers = root.handlers, []
    stderr = io.TextIOWrapper(open(2, "wb", closefd=False), write_through=True)
    with warnings.catch_warnings():
        warnings.resetwarnings()
        for action, category, module in PYTHON_DEFAULT_FILTERS:
            warnings.filterwarnings(action, category=category, module=module, append=True)
        warnings.showwarning = _show
        for h, _ in moved:
            h.setStream(stderr)
        try:
            yield
        finally:
            for h, stream in moved:
                h.setStream(stream)
            root.handlers = pytest_handlers


def _fd(stream) -> int | None:
    try:
        return stream.fileno()
    except (AttributeError, OSError, ValueError):
        return None


@contextlib.contextmanager
def recorded_output():
    """Yields an ``Output``, filled when the block ends (see the module docstring)."""
    result = Output()
    sys.stdout.flush(), sys.stderr.flush()
    with tempfile.TemporaryDirectory() as tmp:
        files, own = [os.path.join(tmp, n) for n in ("out", "err")], os.path.join(tmp, "own")
        Path(own).touch()
        saved_fds, saved_streams = (os.dup(1), os.dup(2)), (sys.stdout, sys.stderr)
        saved_env = {k: os.environ.get(k) for k in (ORIGIN_ENV, "PYTHONPATH")}
        for fd, path in zip((1, 2), files):
            sink = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
            os.dup2(sink, fd)
            os.close(sink)
        sys.stdout, sys.stderr = (
            _Noting(io.TextIOWrapper(open(fd, "wb", closefd=False), write_through=True), own) for fd in (1, 2)
        )
        os.environ[ORIGIN_ENV] = own
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(SITE), saved_env["PYTHONPATH"]) if p)
        try:
            with _shown_as_outside_pytest():
                yield result
        finally:
            sys.stdout.flush(), sys.stderr.flush()
            sys.stdout, sys.stderr = saved_streams
            for fd, saved in zip((1, 2), saved_fds):
                os.dup2(saved, fd)
                os.close(saved)
            for k, v in saved_env.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
            result.stdout, result.stderr = (Path(f).read_text(errors="replace") for f in files)
            result.own = Path(own).read_text(errors="replace").splitlines()
