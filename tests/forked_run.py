"""``subprocess.run([python, "-m", module, *args], capture_output=True, text=True)`` for a module
whose imports are the runner's (torch, diffusers, transformers: 6 s of CPU in a fresh interpreter):
the process is forked from the runner's zygote (``harness/zygote.py``), which the test process has
started already or keeps for its next runner. It is a process of its own, with its own exit code,
stdout and stderr; only its imports were done before it started. For a test of what a start
imports, run a fresh interpreter instead."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

from harness.processes import REPO, ZYGOTE_IMPORTS
from harness.zygote import zygote_for

RUNNER = "runner_service.main"


def run_forked(module: str, *args: str, env: dict[str, str] | None = None,
               timeout: float = 100.0) -> subprocess.CompletedProcess[str]:
    """``python -m module args`` run to its end, forked where that is the same process (as
    ``harness.processes.start_service`` decides), else a fresh interpreter; ``env`` is added to this
    process's environment."""
    environment = {**os.environ, "PYTHONUNBUFFERED": "1"}  # start_service's, so its zygote serves both
    wanted = {**environment, **(env or {})}
    command = [module, *args]
    with tempfile.TemporaryDirectory(prefix="forked-run-") as directory:
        stdout, stderr = Path(directory) / "stdout", Path(directory) / "stderr"
        stdout.touch()
        stderr.touch()
        process = None
        if os.environ.get("HARNESS_EXEC") != "1":
            zygote = zygote_for(ZYGOTE_IMPORTS[RUNNER], REPO, environment)
            process = zygote.spawn(module, list(args), REPO, wanted, stdout, stderr)
        if process is None:
            return subprocess.run([sys.executable, "-m", *command], cwd=REPO, env=wanted, capture_output=True,
                                  text=True, timeout=timeout)
        try:
            code = process.wait(timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
            raise
        return subprocess.CompletedProcess(command, code, stdout.read_text(), stderr.read_text())
