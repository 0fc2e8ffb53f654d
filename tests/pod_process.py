"""deploy/pod.py (``make run``) or ``diffusion serve`` as a real child process, for the tests of the launcher."""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from grpc_health.v1 import health_pb2

from harness.processes import REPO, free_port, health_status

READINESS = "diffusion.v1.WorkerService"
# The worker's metrics and HTTP servers off: a pod beside other pods, which may hold the default ports.
NO_HTTP = ("--metrics-port", "0", "--http-port", "0")
SERVING = health_pb2.HealthCheckResponse.SERVING


class Pod:
    """deploy/pod.py as a child process, its output collected line by line; with ``make``, started as
    ``make run`` starts it (make its parent, this process its grandparent); with ``serve``, the
    installed console script's ``diffusion serve`` (``args`` then hold the model), in ``cwd``. Its
    worker and runner listen on free loopback ports unless ``worker`` or ``runner`` name an address."""

    def __init__(self, *args: str, make: bool = False, serve: bool = False, cwd: Path = REPO,
                 worker: str | None = None, runner: str | None = None) -> None:
        self.worker = worker or f"127.0.0.1:{free_port()}"
        self.runner = runner or f"127.0.0.1:{free_port()}"
        pod_args = ["--worker-listen", self.worker, "--runner-listen", self.runner, "--device", "cpu", *args]
        bin_dir = Path(sys.executable).parent
        if make:  # make's own recipe, with this interpreter's venv and without install (it is installed)
            command = ["make", "--no-print-directory", "-o", "install", "run", f"BIN={bin_dir}",
                       f"ARGS={shlex.join(pod_args)}"]
        elif serve:
            command = [str(bin_dir / "diffusion"), "serve", *pod_args]
        else:
            command = [sys.executable, str(REPO / "deploy" / "pod.py"), *pod_args]
        self.process = subprocess.Popen(command, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                        text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self.lines: list[str] = []
        self._child_starts: dict[int, int | None] = {}  # each child's start time, read as its pid is logged
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.process.stdout:  # type: ignore[union-attr]
            self.lines.append(line.rstrip("\n"))
            if child := re.fullmatch(r"\[pod\] (?:worker|runner) pid (\d+)", self.lines[-1]):
                self._child_starts[int(child.group(1))] = start_time(int(child.group(1)))

    def output(self) -> str:
        return "\n".join(self.lines)

    def pids(self, name: str) -> list[int]:
        return [int(m.group(1)) for line in list(self.lines)
                if (m := re.fullmatch(rf"\[pod\] {name} pid (\d+)", line))]

    def wait_for(self, condition, what: str, timeout: float = 60.0):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if (value := condition()):
                return value
            assert self.process.poll() is None, f"pod exited while waiting for {what}:\n{self.output()}"
            time.sleep(0.1)
        raise AssertionError(f"no {what} after {timeout}s:\n{self.output()}")

    def wait_ready(self, timeout: float = 60.0) -> None:
        self.wait_for(lambda: health_status(self.worker, READINESS, 1.0) == SERVING, "ready worker", timeout)

    def wait_exit(self, timeout: float) -> int:
        """The pod's exit code, once it has exited and its output is all read."""
        try:
            code = self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"the pod did not exit in {timeout}s:\n{self.output()}") from None
        self.reader.join(timeout)
        return code

    def kill_all(self) -> None:
        """SIGKILL to the pod and to each child it logged that still runs: a child is known by its pid
        and its start time, so a pid the system has since given to another process is left alone."""
        children = [pid for pid, started in self._child_starts.items()
                    if started is not None and start_time(pid) == started]
        for pid in [*children, self.process.pid]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.process.wait()


def start_time(pid: int) -> int | None:
    """When process ``pid`` started (clock ticks after boot), or None when there is none."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    except (FileNotFoundError, ProcessLookupError):
        return None


def exited(pid: int) -> bool:
    """No process ``pid``, or only its zombie (an orphan's, before init reaps it)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def gone(pid: int, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if exited(pid):
            return True
        time.sleep(0.05)
    return False
