"""Service processes forked from a process that has already imported them: a start costs the fork and
the service's own set-up, not its imports again.

A runner's imports (torch, diffusers, transformers, peft) take 4 s of CPU on the 2-core machine and
a worker's about 1 s, and the suite starts well over a hundred of them. So the harness starts, once
per test process and per service module, a *zygote*: ``python -m harness.zygote MODULE...``, which
imports the modules and then forks a child for each start it is asked for. The child is a real
process with its own pid: it takes its arguments, working directory, environment and log file from
the request, runs the module as ``python -m MODULE`` would (``runpy``, as ``__main__``), and ends as
the interpreter ends (threads joined, exit handlers run, the exit code of its ``SystemExit``). Its
signals are its own; the zygote reaps it and sends its exit status to the test process, where
:class:`ForkedProcess` answers as ``subprocess.Popen`` does.

A start falls back to a fresh interpreter (``start_service`` execs) where a fork would not be the
same process: when the zygote runs more than one thread after its imports (a fork keeps only the
forking one; ``OMP_NUM_THREADS=1``, which the suite sets, keeps torch's import single-threaded), or
when the start's environment differs from the zygote's in anything but ``TMPDIR``, pytest's
``PYTEST_CURRENT_TEST``, transformers' ``USE_HUB_KERNELS`` and the services' own ``DIFFUSION_*``
variables, which are read when used, not when imported (libraries such as ``huggingface_hub`` read
theirs at import). The entry points themselves (``diffusion-runner``, ``deploy/pod.py``,
``make run``) are tested as executables elsewhere.
"""

from __future__ import annotations

import atexit
import importlib
import json
import os
import runpy
import select
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import traceback
from pathlib import Path
from typing import Any

# What a start may change in the environment the zygote imported its modules in: the temporary
# directory, pytest's name of the test under way, which it sets at every test's every phase,
# USE_HUB_KERNELS, which transformers reads at each load and ``quiet_libraries`` sets in any process
# that calls ``diffusion-build-model``'s main (tests that build a model in the test process), and
# the address inductor sets in any process that loads a compiled kernel, before each load (a test
# that compiles in process made every later start of its test process a fresh interpreter).
_RUNTIME_VARIABLES = ("TMPDIR", "PYTEST_CURRENT_TEST", "USE_HUB_KERNELS", "_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR")
_RUNTIME_PREFIX = "DIFFUSION_"


class ForkedProcess:
    """A zygote's child as the test process sees it, with ``subprocess.Popen``'s calls: its exit
    status comes over the connection that asked for it."""

    def __init__(self, pid: int, connection: socket.socket, args: list[str]) -> None:
        self.pid = pid
        self.args = args
        self.returncode: int | None = None
        self._connection = connection

    def poll(self) -> int | None:
        if self.returncode is None and select.select([self._connection], [], [], 0)[0]:
            self._read_status()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            if not select.select([self._connection], [], [], timeout)[0]:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
            self._read_status()
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:  # as Popen: never a signal to a pid that may have been reused
            os.kill(self.pid, signum)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def _read_status(self) -> None:
        line = self._connection.makefile("r").readline()
        self._connection.close()
        if not line:
            raise RuntimeError(f"the zygote of process {self.pid} ended before it: its exit status is lost")
        self.returncode = int(json.loads(line)["returncode"])


class Zygote:
    """The test process's handle on one zygote: ``spawn`` forks a child, or says None where a fresh
    interpreter must start it."""

    def __init__(self, modules: tuple[str, ...], cwd: Path, env: dict[str, str]) -> None:
        self._env = env
        self._socket = Path(tempfile.mkdtemp(prefix="zygote-")) / "socket"
        self._process = subprocess.Popen(
            [sys.executable, "-m", "harness.zygote", str(self._socket), *modules], cwd=cwd, env=env,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        assert self._process.stdout is not None
        ready = self._process.stdout.readline()
        self.usable = bool(ready) and json.loads(ready)["threads"] == 1

    def spawn(self, module: str, args: list[str], cwd: Path, env: dict[str, str],
              log_path: Path, stderr_path: Path | None = None) -> ForkedProcess | None:
        """The child writes its stdout and stderr to ``log_path``, its stderr to ``stderr_path`` where given."""
        if not self.usable or not _same_imports(self._env, env):
            return None
        connection = socket.socket(socket.AF_UNIX)
        connection.connect(str(self._socket))
        request = {"module": module, "args": args, "cwd": str(cwd), "env": env, "log": str(log_path),
                   "stderr": str(stderr_path or log_path)}
        connection.sendall(json.dumps(request).encode() + b"\n")
        connection.settimeout(60.0)  # the zygote answers as soon as it has forked
        # Read byte by byte: a buffered reader could take the exit status that may follow the pid.
        reply = b""
        while not reply.endswith(b"\n"):
            chunk = connection.recv(1)
            if not chunk:
                raise RuntimeError(f"the zygote for {module} did not start it")
            reply += chunk
        connection.settimeout(None)
        return ForkedProcess(int(json.loads(reply)["pid"]), connection, [module, *args])

    def close(self) -> None:
        """Ends the zygote (its stdin closes) and removes its socket's directory; children it started
        live on, as Popen's do."""
        if self._process.stdin is not None:
            self._process.stdin.close()
        self._process.wait()
        shutil.rmtree(self._socket.parent, ignore_errors=True)


def _same_imports(imported: dict[str, str], wanted: dict[str, str]) -> bool:
    """Whether ``wanted`` differs from ``imported`` only in variables read at run time."""
    changed = {key for key in imported.keys() | wanted.keys() if imported.get(key) != wanted.get(key)}
    return all(key in _RUNTIME_VARIABLES or key.startswith(_RUNTIME_PREFIX) for key in changed)


_ZYGOTES: dict[tuple[str, ...], Zygote] = {}


def zygote_for(modules: tuple[str, ...], cwd: Path, env: dict[str, str]) -> Zygote:
    """This test process's zygote for ``modules``, started at its first use with ``env`` and ended
    when the test process exits."""
    if modules not in _ZYGOTES:
        if not _ZYGOTES:
            atexit.register(_close_all)
        _ZYGOTES[modules] = Zygote(modules, cwd, env)
    return _ZYGOTES[modules]


def _close_all() -> None:
    for zygote in _ZYGOTES.values():
        zygote.close()


# The zygote process itself.


def _serve(path: str, modules: list[str]) -> None:
    for module in modules:
        importlib.import_module(module)
    threads = len(os.listdir("/proc/self/task"))
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(path)
    listener.listen(16)
    print(json.dumps({"threads": threads}), flush=True)
    if threads != 1:
        return
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_write, False)
    signal.set_wakeup_fd(wake_write)
    signal.signal(signal.SIGCHLD, lambda signum, frame: None)
    children: dict[int, socket.socket] = {}
    selector = selectors.EpollSelector()
    selector.register(listener, selectors.EVENT_READ, "start")
    selector.register(wake_read, selectors.EVENT_READ, "reap")
    selector.register(sys.stdin, selectors.EVENT_READ, "stdin")
    while True:
        for key, _ in selector.select():
            if key.data == "stdin" and not os.read(sys.stdin.fileno(), 4096):
                return  # the test process is gone
            if key.data == "start":
                connection, _ = listener.accept()
                request = json.loads(connection.makefile("r").readline())
                pid = os.fork()
                if pid == 0:
                    _run_child(request, closing=[listener.fileno(), connection.fileno(), wake_read, wake_write,
                                                 selector.fileno(),
                                                 *(other.fileno() for other in children.values())])
                children[pid] = connection
                connection.sendall(json.dumps({"pid": pid}).encode() + b"\n")
            if key.data == "reap":
                os.read(wake_read, 4096)
                _reap(children)


def _reap(children: dict[int, socket.socket]) -> None:
    while children:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            return
        connection = children.pop(pid, None)
        if connection is not None:
            connection.sendall(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}).encode() + b"\n")
            connection.close()


def _run_child(request: dict[str, Any], closing: list[int]) -> None:
    """In the forked child: becomes ``python -m MODULE ARGS`` and never returns."""
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    for fd in closing:
        os.close(fd)
    null = os.open(os.devnull, os.O_RDONLY)
    log, errors = (os.open(request[key], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644) for key in ("log", "stderr"))
    for source, target in ((null, 0), (log, 1), (errors, 2)):
        os.dup2(source, target)
    for fd in (null, log, errors):
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    tempfile.tempdir = None  # TMPDIR is read again
    sys.argv = [request["module"], *request["args"]]
    sys.modules.pop(request["module"], None)  # as under ``python -m``: the module runs as __main__ alone
    code = 0
    try:
        runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
    except SystemExit as exit_:
        if exit_.code is None or isinstance(exit_.code, int):
            code = exit_.code or 0
        else:
            print(exit_.code, file=sys.stderr)
            code = 1
    except BaseException:  # noqa: BLE001 - as the interpreter: the traceback, then exit code 1
        traceback.print_exc()
        code = 1
    threading._shutdown()  # type: ignore[attr-defined]  # the interpreter's own end: non-daemon threads joined
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    _serve(sys.argv[1], sys.argv[2:])
