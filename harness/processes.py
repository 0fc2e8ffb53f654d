"""Real service processes for the tests and the benchmarks: started as subprocesses, waited on through gRPC health."""

from __future__ import annotations

import fcntl
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TypeVar

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from diffusion.v1 import worker_pb2, worker_pb2_grpc
from harness.zygote import zygote_for

REPO = Path(__file__).resolve().parent.parent
T = TypeVar("T")


PORT_LOCKS = Path(tempfile.gettempdir()) / "diffusion-harness-ports"
FIRST_PORT = 20000
# A deadline for a start, never a measure: on two cores shared with other runs a runner's imports
# alone can take a minute.
START_TIMEOUT_S = 240.0
_HELD_PORTS: dict[int, int] = {}  # port -> the open lock file that reserves it while this process lives


def _unassigned_ports() -> range:
    """Ports the kernel never picks for an outgoing connection or a bind to port 0 (below its
    ephemeral range, else above it): a port chosen here stays free until a service binds it."""
    low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    return range(FIRST_PORT, low) if low - FIRST_PORT >= 1000 else range(high + 1, 65536)


def free_port() -> int:
    """A loopback port nothing listens on, reserved for this process until it exits.

    Servers bind their port exclusively (gRPC's SO_REUSEPORT is off), so a port two starts were
    given would fail the second. Hence no port is handed out twice while its holder lives, across
    every process using this harness (concurrent test runs): each is claimed with an flock on a file
    in ``PORT_LOCKS``, which the kernel releases when the process ends, and the ports are outside the
    kernel's ephemeral range, where no client connection can take one meanwhile."""
    PORT_LOCKS.mkdir(exist_ok=True)
    ports = _unassigned_ports()
    while True:
        port = random.choice(ports)
        if port in _HELD_PORTS:
            continue
        fd = os.open(PORT_LOCKS / str(port), os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            with socket.socket() as probe:  # someone outside the harness may listen there
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                probe.bind(("127.0.0.1", port))
        except OSError:  # held by another process, or taken
            os.close(fd)
            continue
        _HELD_PORTS[port] = fd
        return port


def wait_until(predicate: Callable[[], T], timeout: float, what: str, interval: float = 0.05) -> T:
    """The first truthy value of ``predicate()``, polled every ``interval`` s for up to ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(interval)


def health_status(target: str, service: str = "", timeout: float = 2.0) -> int | None:
    """The health status of ``service`` at ``target``, or None when it cannot be reached."""
    with grpc.insecure_channel(target) as channel:
        try:
            response = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout
            )
        except grpc.RpcError:
            return None
    status: int = response.status
    return status


class ProcessHandle(Protocol):
    """What the tests use of a service's process: ``subprocess.Popen``'s calls, which a zygote's
    child (``harness.zygote.ForkedProcess``) answers too."""

    @property
    def pid(self) -> int: ...

    @property
    def returncode(self) -> int | None: ...

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...

    def send_signal(self, signum: int) -> None: ...

    def kill(self) -> None: ...


@dataclass
class ServiceProcess:
    """A service started as a child process; ``stop`` sends a real signal and waits."""

    name: str
    target: str
    process: ProcessHandle
    log_path: Path
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def pid(self) -> int:
        return self.process.pid

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_healthy(self, service: str = "", timeout: float = START_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.process.returncode}:\n{self.log()}")
            if health_status(self.target, service, timeout=1.0) == health_pb2.HealthCheckResponse.SERVING:
                return
            time.sleep(0.1)
        raise TimeoutError(f"{self.name} not SERVING for {service!r} after {timeout}s:\n{self.log()}")

    @contextmanager
    def frozen(self) -> Iterator[None]:
        """The process stopped with SIGSTOP for the block, continued with SIGCONT after: the work it
        has in hand stays in flight, at the step it reached, however fast or slow the machine."""
        self.process.send_signal(signal.SIGSTOP)
        try:
            yield
        finally:
            self.process.send_signal(signal.SIGCONT)

    def stop(self, signum: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signum)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
        return self.process.wait()


# What each service's zygote imports (``harness/zygote.py``): its main module and what its start
# imports after parsing its flags; the runner's also fills the caches of a first load
# (``harness.runner_warm_up``). HARNESS_EXEC=1 starts every service as a fresh interpreter.
ZYGOTE_IMPORTS = {
    "runner_service.main": ("runner_service.main", "runner_service.core", "runner_service.service",
                            "harness.runner_warm_up"),
    "worker_service.main": ("worker_service.main",),
}


def start_service(name: str, module: str, args: list[str], log_dir: Path, target: str,
                  env: dict[str, str] | None = None, fresh: bool = False) -> ServiceProcess:
    """Starts ``python -m module args``, forked from the module's zygote where that is the same
    process (``harness.zygote``), else (and always when ``fresh``: a test of what its imports do) as
    a fresh interpreter; its output goes to a log in ``log_dir``, which exists when this returns."""
    log_path = log_dir / f"{name}-{time.monotonic_ns()}.log"
    log_path.touch()
    environment = {**os.environ, "PYTHONUNBUFFERED": "1"}
    process: ProcessHandle | None = None
    if module in ZYGOTE_IMPORTS and not fresh and os.environ.get("HARNESS_EXEC") != "1":
        zygote = zygote_for(ZYGOTE_IMPORTS[module], REPO, environment)
        process = zygote.spawn(module, args, REPO, {**environment, **(env or {})}, log_path)
    if process is None:
        with log_path.open("wb") as log_file:
            process = subprocess.Popen([sys.executable, "-m", module, *args], cwd=REPO, stdout=log_file,
                                       stderr=subprocess.STDOUT, env={**environment, **(env or {})})
    return ServiceProcess(name=name, target=target, process=process, log_path=log_path)


def start_runner(log_dir: Path, *args: str, env: dict[str, str] | None = None,
                 target: str | None = None, fresh: bool = False) -> ServiceProcess:
    """Starts ``diffusion-runner`` on ``target`` (a free loopback port by default) and waits until it
    serves; ``fresh``: as a fresh interpreter (``start_service``)."""
    target = target or f"127.0.0.1:{free_port()}"
    runner = start_service("runner", "runner_service.main",
                           ["--listen", target, "--device", "cpu", *args], log_dir, target, env, fresh)
    runner.wait_healthy("diffusion.v1.RunnerService")
    return runner


def start_fake_runner(log_dir: Path, step_s: float = 0.0, target: str | None = None) -> ServiceProcess:
    """Starts the torch-free fake runner (``tests/fake_runner.py``) on ``target`` (a free loopback port by
    default), each step taking ``step_s`` s, and waits until it serves: for tests of the worker's
    behaviour with a runner process to kill or freeze that starts in a second."""
    target = target or f"127.0.0.1:{free_port()}"
    runner = start_service("fake-runner", "tests.fake_runner", ["--listen", target, "--step-s", str(step_s)],
                           log_dir, target)
    runner.wait_healthy("diffusion.v1.RunnerService")
    return runner


def start_worker(log_dir: Path, runner_target: str, *args: str, ready: bool = True,
                 env: dict[str, str] | None = None, target: str | None = None) -> ServiceProcess:
    """Starts ``diffusion-worker`` against ``runner_target``; waits for readiness when ``ready``.

    Metrics and the OpenAI HTTP API are off (``--metrics-port 0 --http-port 0``) unless ``args`` ask
    for a port: workers run side by side."""
    target = target or f"127.0.0.1:{free_port()}"
    worker = start_service("worker", "worker_service.main",
                           ["--listen", target, "--runner", runner_target, "--metrics-port", "0", "--http-port", "0",
                            *args],
                           log_dir, target, env)
    worker.wait_healthy("diffusion.v1.WorkerService" if ready else "")
    return worker


@contextmanager
def worker_stub(target: str, warm: bool = True) -> Iterator[worker_pb2_grpc.WorkerServiceStub]:
    """A WorkerService stub; ``warm`` runs a 1-step request first (a fresh runner's first run is slow)."""
    with grpc.insecure_channel(target) as channel:
        stub = worker_pb2_grpc.WorkerServiceStub(channel)
        if warm:
            stub.Generate(worker_pb2.GenerateRequest(num_inference_steps=1), timeout=120)
        yield stub
