"""A warm Python for ``bench/gpu_all.sh --cpu-smoke``: every ``$PY ...`` of the smoke run is a fork
of one process that imported torch, transformers and ndparallel once, instead of a fresh interpreter
that imports them again (~5 s of CPU each, ~30 times a run). The GPU run never uses it.

    python bench/_warm_python.py serve SOCKET [MODULE...]  # imports (preload_modules), answers on SOCKET
    python -S bench/_warm_python.py run SOCKET ARGS...   # what `$PY ARGS...` runs: `python ARGS...`

``run`` sends its argv, working directory, environment and standard streams (the file descriptors
themselves) to the server, which forks a child that runs ``python ARGS`` as a fresh interpreter
would (``-m MODULE``, ``-c CODE``, ``-`` for a script on stdin, or a script path: a new
``__main__``, ``sys.argv`` and ``sys.path[0]`` as Python sets them) and reports its exit status,
which ``run`` exits with (a death by signal included). SIGTERM, SIGINT, SIGHUP and SIGQUIT to
``run`` go to the child's process group; ``run`` killed (``timeout -k``) kills that group.

A fresh interpreter runs the command instead (``os.execv``, nothing said) when the server is not
there, for any other command line, and when a variable that acts at import time (``PYTHON*``,
``OMP_*``, ``MKL_*``, ``CUDA_*``, ``HF_*``, ``TORCH*``, ``TRANSFORMERS*``, ``TOKENIZERS*``,
``TMP*``, ``XDG_*``, ``HOME``) differs from the server's: what the child
inherits was imported under the server's. The server ends with its parent (gpu_all.sh) or on
SIGTERM, killing its children's groups. Bench scripts start child interpreters with
``child_python()``: ``sys.executable``, or this warm one under the smoke run.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import struct
import sys

STEP_MODULES = (
    "transformers.models.llama.modeling_llama",
    "peft",
    "accelerate",
    "ndparallel.cli",
    "ndparallel.cli.commands",
    "ndparallel.training.trainer",
    "pytest",
)
"""What the smoke steps import besides ndparallel's ``MODEL_LIBRARIES`` (``preload_modules``); one
that fails to import is left to the step (its error included)."""


def preload_modules() -> tuple[str, ...]:
    """The server's default imports: ``runtime/startup.py``'s ``MODEL_LIBRARIES``, then
    ``STEP_MODULES`` (imported here, not at the top: the client runs with ``-S``)."""
    try:
        from ndparallel.runtime.startup import MODEL_LIBRARIES
    except ImportError:
        return STEP_MODULES
    return (*MODEL_LIBRARIES, *STEP_MODULES)


IMPORT_TIME_ENV = ("PYTHON", "OMP_", "MKL_", "KMP_", "CUDA_", "HF_", "TORCH", "TRANSFORMERS", "TOKENIZERS")
IMPORT_TIME_ENV += ("TMP", "XDG_", "HOME")  # (ndparallel reads its own at run time)
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)


def _import_env(env: dict) -> dict:
    return {k: v for k, v in env.items() if k.startswith(IMPORT_TIME_ENV)}


def _supported(args: list[str]) -> bool:
    if not args:
        return False
    if args[0] in ("-m", "-c"):
        return len(args) >= 2
    return args[0] == "-" or not args[0].startswith("-")


def _in_folder_of(path: str, op) -> None:
    """``op(name)`` with the working directory at ``path``'s folder: a Unix socket's address holds
    at most 107 bytes, and a path under pytest's tmp_path can be longer (the folder keeps 0700)."""
    here = os.open(".", os.O_RDONLY)
    try:
        os.chdir(os.path.dirname(os.path.abspath(path)))
        op(os.path.basename(path))
    finally:
        os.fchdir(here)
        os.close(here)


# ------------------------------------------------------------------------------------- the client
def _fresh(args: list[str]):
    os.execv(sys.executable, [sys.executable, *args])


def client(path: str, args: list[str]) -> int:
    if not _supported(args):
        _fresh(args)
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        _in_folder_of(path, conn.connect)
        header = json.dumps({"argv": args, "cwd": os.getcwd(), "env": dict(os.environ)}).encode()
        socket.send_fds(conn, [b"R"], [0, 1, 2])
        conn.sendall(struct.pack("!I", len(header)) + header)
    except OSError:
        conn.close()
        _fresh(args)
    replies = conn.makefile("r")
    first = replies.readline().split()
    if len(first) != 2 or first[0] != "pid":
        conn.close()
        _fresh(args)  # "fresh": the server cannot run this one warm
    pid = int(first[1])
    for sig in FORWARDED:
        signal.signal(sig, lambda signum, _frame: _kill_group(pid, signum))
    last = replies.readline().split()
    if len(last) != 2 or last[0] != "exit":
        print("_warm_python: the server ended before the command did", file=sys.stderr)
        return 1
    code = int(last[1])
    if code < 0:  # the child died of a signal: so does this process, as the shell would see it
        if -code != signal.SIGKILL:
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
        return 128 - code
    return code


def _kill_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except OSError:
        pass


# ------------------------------------------------------------------------------------- the server
def _preload(modules) -> None:
    import gc
    import importlib

    gc.disable()
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001, S110 - the step that needs it reports it
            pass
    gc.enable()
    gc.freeze()  # as ndparallel.runtime.startup: never walked again, never copied by a fork


def serve(path: str, modules: tuple[str, ...]):
    """Answer until the parent ends; returns only in a forked child: what it is to run."""
    before = dict(os.environ)
    _preload(modules)
    made = {k: v for k, v in os.environ.items() if before.get(k) != v}  # by the imports (inductor's cache)
    me, parent, own_env = os.getpid(), os.getppid(), _import_env(before)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    _in_folder_of(path + ".new", listener.bind)
    listener.listen(16)
    os.rename(path + ".new", path)  # ready: clients connect from now on
    children: dict[int, socket.socket] = {}  # child pid -> its client's connection
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    try:
        while not stop and os.getppid() == parent:
            conns = list(children.values())
            ready, _, _ = select.select([listener, *conns], [], [], 0.05)
            for conn in ready:
                if conn is listener:
                    job = _accept(listener, (own_env, made), children)
                    if job is not None:  # this is the child: the imports' variables, as in a fresh one
                        listener.close()
                        job[0]["env"].update(made)
                        return job
                else:  # a client said nothing more: it ended (killed) before its command did
                    pid = next(p for p, c in children.items() if c is conn)
                    _kill_group(pid, signal.SIGKILL)
                    _count_cpu(path + ".cpu", os.wait4(pid, 0)[2])
                    children.pop(pid).close()
            _reap(children, path + ".cpu")
    finally:
        if os.getpid() == me:  # the server's own end (not a forked child's return)
            for pid in children:
                _kill_group(pid, signal.SIGKILL)
            os.unlink(path)
    return None


def _accept(listener: socket.socket, envs: tuple[dict, dict], children: dict):
    conn, _ = listener.accept()
    try:
        _, fds, _, _ = socket.recv_fds(conn, 1, 3)
        (size,) = struct.unpack("!I", _recv_exactly(conn, 4))
        request = json.loads(_recv_exactly(conn, size))
    except (OSError, ValueError, struct.error):
        conn.close()
        return None
    own_env, made = envs  # a command of a warm one carries what the imports set: as if unset
    env = {k: v for k, v in request["env"].items() if made.get(k) != v}
    if len(fds) != 3 or _import_env(env) != own_env:
        conn.sendall(b"fresh\n")
        conn.close()
        for fd in fds:
            os.close(fd)
        return None
    sys.stdout.flush(), sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        for other in children.values():
            other.close()
        conn.close()
        return request, fds
    for fd in fds:
        os.close(fd)
    try:
        os.setpgid(pid, pid)  # also here: a signal forwarded at once finds the group
    except OSError:
        pass
    conn.sendall(f"pid {pid}\n".encode())
    children[pid] = conn
    return None


def _count_cpu(cpu_file: str, usage) -> None:
    """The children's CPU seconds (user + sys, their own children's included), a running total in
    ``SOCKET.cpu``: what gpu_all.sh's per-step CPU figure adds to its shell's children's."""
    try:
        with open(cpu_file) as f:
            total = float(f.read() or 0)
    except OSError:
        total = 0.0
    with open(cpu_file + ".new", "w") as f:
        f.write(f"{total + usage.ru_utime + usage.ru_stime:.2f}")
    os.replace(cpu_file + ".new", cpu_file)


def _recv_exactly(conn: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        more = conn.recv(n - len(data))
        if not more:
            raise ValueError("short request")
        data += more
    return data


def _reap(children: dict, cpu_file: str) -> None:
    while children:
        pid, status, usage = os.wait4(-1, os.WNOHANG)
        if pid == 0:
            return
        _count_cpu(cpu_file, usage)
        conn = children.pop(pid, None)
        if conn is not None:
            try:
                conn.sendall(f"exit {os.waitstatus_to_exitcode(status)}\n".encode())
            except OSError:
                pass
            conn.close()


def child_python() -> str:
    """The interpreter a bench script starts a child Python with: its own, or under gpu_all.sh
    --cpu-smoke the warm one (``GPU_ALL_WARM_PY``: this module's client)."""
    return os.environ.get("GPU_ALL_WARM_PY") or sys.executable


# ----------------------------------------------------------------------------- the forked command
def run_job(request: dict, fds: list[int]) -> None:
    """In the forked child: become ``python ARGV`` in the client's directory and environment."""
    import ctypes
    import types

    try:
        os.setpgid(0, 0)
    except OSError:
        pass
    prctl = getattr(ctypes.CDLL(None), "prctl", None)  # Linux
    if prctl is not None:
        prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: the server killed, so is this command
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    sys.excepthook = _excepthook
    main = types.ModuleType("__main__")
    main.__dict__["__builtins__"] = __builtins__
    sys.modules["__main__"] = main
    args = request["argv"]
    if args[0] == "-m":
        import runpy

        sys.argv[:] = ["-m", *args[2:]]
        sys.path[0] = os.getcwd()
        runpy._run_module_as_main(args[1])  # what `python -m` calls
        return
    if args[0] == "-c":
        sys.argv[:], sys.path[0], name, source = ["-c", *args[2:]], "", "<string>", args[1]
    elif args[0] == "-":
        sys.argv[:], sys.path[0], name, source = ["-", *args[1:]], "", "<stdin>", sys.stdin.read()
    else:
        script = os.path.abspath(args[0])
        sys.argv[:], sys.path[0], name = list(args), os.path.dirname(os.path.realpath(script)), args[0]
        with open(script, "rb") as f:
            source = f.read()
        main.__file__ = args[0]
    main.__dict__["__cached__"] = None
    exec(compile(source, name, "exec"), main.__dict__)


def _excepthook(kind, value, tb) -> None:
    """Python's own, without this file's frames: the traceback a fresh interpreter prints."""
    while tb is not None and tb.tb_frame.f_code.co_filename == __file__:
        tb = tb.tb_next
    sys.__excepthook__(kind, value.with_traceback(tb), tb)


if __name__ == "__main__":
    mode, sock = sys.argv[1], sys.argv[2]
    if mode == "run":
        sys.exit(client(sock, sys.argv[3:]))
    job = serve(sock, tuple(sys.argv[3:]) or preload_modules())
    if job is not None:
        run_job(*job)
