"""Python run as its own process, forked from the runner's zygote (``harness.zygote``) where that is
the same process: ``run_code`` runs code as ``python -c CODE`` does, ``run_module`` a module as
``python -m MODULE ARGS`` does, each in a working directory of the caller's.

What the docs' tests run this way (the docs' Python blocks, the built-in adapters a page registers)
imports the clients, torch and diffusers: a fresh interpreter pays those imports every time (about
5 s of CPU with torch on the 2-core machine), a child of the zygote, which has imported them
already, pays none. The child is still a process of its own (its cwd, ``__main__``, stdout and
exit code are its own), so what a reader's ``python`` would do is what the test sees. Where no fork
can serve (``Zygote.spawn``'s rules, or ``HARNESS_EXEC=1``) a fresh interpreter runs it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import types
from pathlib import Path

from harness.processes import REPO, ZYGOTE_IMPORTS
from harness.zygote import zygote_for

_ZYGOTE_MODULES = ZYGOTE_IMPORTS["runner_service.main"]


def run_code(code: str, cwd: Path, timeout: float) -> subprocess.CompletedProcess[str]:
    """``python -c code`` in ``cwd``, with the repository importable; raises ``subprocess.TimeoutExpired``
    (the process killed) past ``timeout`` s."""
    return _run(__name__, [code], ["-c", code], cwd, timeout)


def run_module(module: str, args: list[str], cwd: Path = REPO, timeout: float = 100.0,
               env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``python -m module args`` in ``cwd``, with the repository importable and ``env`` added to this
    process's environment (see ``run_code``). For a test of what a start imports, run a fresh
    interpreter instead."""
    return _run(module, args, ["-m", module, *args], cwd, timeout, env or {})


def _run(module: str, args: list[str], fresh_args: list[str], cwd: Path, timeout: float,
         env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    zygote_environment = {**os.environ, "PYTHONUNBUFFERED": "1"}  # as harness.processes starts the zygote
    environment = {**zygote_environment, **(env or {})}
    command = [sys.executable, *fresh_args]
    if os.environ.get("HARNESS_EXEC") != "1":
        with tempfile.TemporaryDirectory(prefix="forked-python-") as outputs:
            stdout, stderr = Path(outputs) / "stdout", Path(outputs) / "stderr"
            child = zygote_for(_ZYGOTE_MODULES, REPO, zygote_environment).spawn(module, args, cwd, environment,
                                                                               stdout, stderr)
            if child is not None:
                try:
                    returncode = child.wait(timeout)
                except subprocess.TimeoutExpired:
                    child.kill()
                    child.wait()
                    raise
                return subprocess.CompletedProcess(command, returncode, stdout.read_text(errors="replace"),
                                                   stderr.read_text(errors="replace"))
    return subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=timeout,
                          env={**environment, "PYTHONPATH": str(REPO)})


def _execute(code: str) -> None:
    """Runs ``code`` as ``python -c`` does: as the ``__main__`` module, with ``sys.argv`` ``['-c']``."""
    main = types.ModuleType("__main__")
    sys.modules["__main__"] = main
    sys.argv = ["-c"]
    exec(compile(code, "<string>", "exec"), main.__dict__)  # noqa: S102 - running the code is the point


if __name__ == "__main__":
    _execute(sys.argv[1])
