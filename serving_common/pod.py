"""The local launcher: a runner and a worker serving one model, like a pod of two containers.

    make run ARGS="--model tiny"           # deploy/pod.py, from a clone
    diffusion serve tiny                   # the same, for an installed package (``clients.cli``)

Starts the runner sidecar and the worker as child processes, prefixes their output, waits until
the worker is ready and prints commands to try. A taken ``--worker-listen`` or ``--runner-listen``
address is reported before anything starts (exit code 1). Ready is said only of this pod's own
worker, the process holding the port, never of another pod's worker answering there. A worker that
reports FAILED before it was first ready (its model did not load) stops everything with exit
code 1, its reason and what the model argument takes. A runner that exits is restarted with
exponential backoff (0.5 s doubling to 10 s, reset once it has been up 30 s); a worker that exits
stops everything with a nonzero exit code. Ctrl-C or SIGTERM stops the worker first, then the
runner, and exits 0. Each start logs ``[pod] runner pid N`` / ``[pod] worker pid N``. The children
die with the pod however it ends, SIGKILL included: each asks Linux for SIGTERM when the pod dies
(``serving_common.supervision``), then drains and exits. The pod asks the same of the process that
started it (``make``, a shell): a ``make run`` killed with SIGKILL stops it as SIGTERM does. The
children run in the pod's working directory, so a relative model directory means the same to them.

The runner accepts only callers with the runner token, which the worker sends: ``--runner-token-file``,
or by default a random token made for this start, in a 0600 file in a private temporary directory
that is removed on exit (the runner's ``--auth-token-file``, the worker's ``--runner-token-file``).
The pod holds a lock on that directory while it lives: one left by a killed pod is removed at the
next start.
"""

from __future__ import annotations

import argparse
import os
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from diffusion.v1 import worker_pb2, worker_pb2_grpc
from serving_common.listen_ports import PORT_IN_USE, bind_error, listens_on
from serving_common.owned_dirs import owned_temporary_directory, remove_abandoned
from serving_common.protocol import BUILTIN_MODEL_NAMES
from serving_common.supervision import PARENT_PID_ENV, die_with_launcher

TOKEN_DIR_PREFIX = "diffusion-pod-"
READINESS = "diffusion.v1.WorkerService"
BACKOFF_START, BACKOFF_MAX, STABLE_AFTER = 0.5, 10.0, 30.0
STOP_TIMEOUT = 20.0
_print_lock = threading.Lock()


@dataclass(frozen=True)
class Invocation:
    """How the pod was started, for what it tells its user: where the ``diffusion`` command is, how
    the model is named on the launcher's command line and an example of choosing one."""

    tools: str  # the prefix of the diffusion and grpcurl commands it suggests
    model_argument: str
    example: str


MAKE_RUN = Invocation(".venv/bin/", "--model", 'make run ARGS="--model tiny"')
SERVE = Invocation("", "MODEL", "diffusion serve tiny")


def log(prefix: str, text: str) -> None:
    with _print_lock:
        sys.stdout.write(f"[{prefix}] {text}\n")
        sys.stdout.flush()


class Child:
    """One child process whose output is copied to ours, each line prefixed with ``[name] ``."""

    def __init__(self, name: str, args: list[str]) -> None:
        """Call from the main thread: the child's death signal comes when the thread that started it ends."""
        self.name = name
        self.started = time.monotonic()
        self.process = subprocess.Popen(
            [sys.executable, "-m", *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1", PARENT_PID_ENV: str(os.getpid())},
            start_new_session=True,  # Ctrl-C reaches only us; we stop the children in order
        )
        threading.Thread(target=self._copy_output, daemon=True).start()
        log("pod", f"{name} pid {self.process.pid}")

    def _copy_output(self) -> None:
        assert self.process.stdout is not None  # stdout=PIPE
        for line in iter(self.process.stdout.readline, b""):
            log(self.name, line.decode(errors="replace").rstrip("\n"))

    def poll(self) -> int | None:
        return self.process.poll()

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                log("pod", f"{self.name} did not stop in {STOP_TIMEOUT:.0f}s; killing it")
                self.process.kill()
                self.process.wait()
        log("pod", f"{self.name} stopped ({self.process.returncode})")


def remove_stale_token_dirs() -> None:
    """Removes the token directories of pods that are gone (killed: no cleanup ran); a live pod's is locked."""
    remove_abandoned(TOKEN_DIR_PREFIX,
                     lambda directory: log("pod", f"removed {directory}, left by a pod that was killed"))


def generated_token_file() -> Path:
    """A new random token in a 0600 file inside a new 0700 temporary directory, locked while we live."""
    path = owned_temporary_directory(TOKEN_DIR_PREFIX) / "runner.token"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as file:
        file.write(secrets.token_urlsafe(32) + "\n")
    return path


def is_ready(stub: health_pb2_grpc.HealthStub) -> bool:
    try:
        response = stub.Check(health_pb2.HealthCheckRequest(service=READINESS), timeout=1.0)
    except grpc.RpcError:
        return False
    return bool(response.status == health_pb2.HealthCheckResponse.SERVING)


def start_failure(stub: worker_pb2_grpc.WorkerServiceStub) -> str | None:
    """The worker's reason when it reports FAILED (its model could not load); None otherwise."""
    try:
        status: worker_pb2.GetStatusResponse = stub.GetStatus(worker_pb2.GetStatusRequest(), timeout=1.0)
    except grpc.RpcError:
        return None
    return status.message if status.state == worker_pb2.WORKER_STATE_FAILED else None


def model_advice(invocation: Invocation) -> str:
    return (f"{invocation.model_argument} takes a built-in model ({', '.join(BUILTIN_MODEL_NAMES)}), the path of a "
            "diffusers model directory (one holding model_index.json) on this machine, or a Hugging Face id "
            f"(org/name) in its hub cache (diffusion models lists them); for example {invocation.example}")


def unusable_addresses(args: argparse.Namespace) -> list[str]:
    """A line for each of the pod's listen addresses that cannot be bound now."""
    lines = []
    for flag, listen in (("--worker-listen", args.worker_listen), ("--runner-listen", args.runner_listen)):
        reason = bind_error(listen)
        if reason == PORT_IN_USE:
            reason += f" (is another pod running? stop it, or pass another {flag})"
        if reason is not None:
            lines.append(f"cannot listen on {listen} ({flag}): {reason}")
    return lines


def banner(worker: str, tools: str) -> str:
    port = worker.rsplit(":", 1)[-1]
    target = "" if worker == "127.0.0.1:50051" else f" --target {worker}"
    return f"""
The worker is ready at {worker}. Try, in another terminal:

  {tools}diffusion{target} generate "a red circle on a blue background" -o circle.png
  {tools}diffusion{target} status
  {tools}grpcurl -plaintext localhost:{port} list
  {tools}grpcurl -plaintext -d '{{"service": "{READINESS}"}}' localhost:{port} grpc.health.v1.Health/Check
  {tools}grpcurl -plaintext localhost:{port} diffusion.v1.WorkerService/GetStatus
  {tools}grpcurl -plaintext -d '{{"level": 1}}' localhost:{port} diffusion.v1.WorkerService/Sleep
  {tools}grpcurl -plaintext localhost:{port} diffusion.v1.WorkerService/WakeUp

Ctrl-C stops both.
"""


def split_worker_flags(argv: list[str]) -> tuple[list[str], list[str]]:
    """The launcher's own arguments, and the worker's: those after the first ``--``."""
    if "--" not in argv:
        return argv, []
    at = argv.index("--")
    return argv[:at], argv[at + 1:]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The launcher's flags (not the model, which ``make run`` and ``diffusion serve`` take differently)."""
    parser.add_argument("--worker-listen", default="127.0.0.1:50051")
    parser.add_argument("--runner-listen", default="127.0.0.1:50052")
    parser.add_argument("--device", default="auto", help="the runner's device: auto, cpu, cuda, npu, ...")
    parser.add_argument("--devices", default="", help="the runner's --devices: a runner group of N devices "
                        "(the worker's --cfg-parallel or --ulysses-degree spreads each request over them)")
    parser.add_argument("--runner-token-file", default=None,
                        help="file holding the token the worker sends the runner (default: a random "
                        "token generated for this start)")


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    own, extra = split_worker_flags(argv)
    assert __doc__ is not None
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False,
                                     epilog="Flags after -- go to the worker.")
    parser.add_argument("--model", default="shapes", help="built-in model name or model directory")
    add_arguments(parser)
    return parser.parse_args(own), extra


def main(argv: list[str] | None = None) -> int:
    """``make run`` (deploy/pod.py)."""
    args, extra = parse_args(sys.argv[1:] if argv is None else argv)
    return run(args, extra, MAKE_RUN)


def run(args: argparse.Namespace, extra: list[str], invocation: Invocation) -> int:
    """Serves ``args.model`` until stopped, the worker taking ``extra`` flags too; the exit code."""
    if unusable := unusable_addresses(args):
        for line in unusable:
            log("pod", line)
        return 1
    die_with_launcher()
    stopping = threading.Event()

    def on_signal(signum: int, _frame: object) -> None:
        log("pod", f"{signal.Signals(signum).name}: stopping")
        stopping.set()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)

    remove_stale_token_dirs()
    if args.runner_token_file:
        token_file, token_dir = Path(args.runner_token_file).resolve(), None
        log("pod", f"runner token from {token_file}")
    else:
        token_file = generated_token_file()
        token_dir = token_file.parent
        log("pod", f"runner token generated in {token_file}")

    def start_runner() -> Child:
        group = ["--devices", args.devices] if args.devices else []
        return Child("runner", ["runner_service.main", "--listen", args.runner_listen,
                                "--device", args.device, *group, "--auth-token-file", str(token_file)])

    try:
        return supervise(args, extra, stopping, start_runner, token_file, invocation)
    finally:
        if token_dir is not None:
            shutil.rmtree(token_dir, ignore_errors=True)


def supervise(args: argparse.Namespace, extra: list[str], stopping: threading.Event,
              start_runner: Callable[[], Child], token_file: Path, invocation: Invocation) -> int:
    """Runs the two children until the worker exits or we are asked to stop; the exit code."""
    runner = start_runner()
    worker = Child("worker", ["worker_service.main", "--listen", args.worker_listen,
                              "--runner", args.runner_listen, "--runner-token-file", str(token_file),
                              "--model", args.model, *extra])
    channel = grpc.insecure_channel(args.worker_listen)
    health = health_pb2_grpc.HealthStub(channel)
    status = worker_pb2_grpc.WorkerServiceStub(channel)
    backoff, ready, announced, code, failure = BACKOFF_START, False, False, 0, None
    try:
        while not stopping.wait(0.5):
            if worker.poll() is not None:
                log("pod", f"worker exited unexpectedly ({worker.poll()}); stopping")
                code = 1
                break
            if runner.poll() is not None:
                uptime = time.monotonic() - runner.started
                if uptime >= STABLE_AFTER:
                    backoff = BACKOFF_START
                log("pod", f"runner exited unexpectedly ({runner.poll()}) after {uptime:.1f}s; "
                           f"restarting in {backoff:g}s")
                if stopping.wait(backoff):
                    break
                runner = start_runner()
                backoff = min(backoff * 2, BACKOFF_MAX)
            if not announced:  # what answers must be our worker, and a start that failed ends the pod
                if not listens_on(worker.process.pid, args.worker_listen):
                    continue
                if (failure := start_failure(status)) is not None:
                    log("pod", "worker FAILED before it was ready; stopping")
                    code = 1
                    break
            now_ready = is_ready(health)
            if now_ready != ready:
                ready = now_ready
                log("pod", "worker ready" if ready else "worker not ready")
                if ready and not announced:
                    announced = True
                    with _print_lock:
                        print(banner(args.worker_listen, invocation.tools), flush=True)
    finally:
        channel.close()
        worker.stop()
        runner.stop()
    if failure is not None:
        log("pod", f"worker FAILED: {failure}")
        log("pod", model_advice(invocation))
    return code
