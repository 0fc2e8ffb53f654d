"""What many test modules need: a default request, an image's pixels, the CLI called in-process, and
a runner-and-worker pair (real runner, or the torch-free fake runner process)."""

from __future__ import annotations

import contextlib
import io
import os
import signal
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image

from clients import cli as cli_module
from diffusion.v1 import worker_pb2
from harness.processes import ServiceProcess, free_port, start_fake_runner, start_runner, start_worker

W = worker_pb2


def request(**fields: object) -> worker_pb2.GenerateRequest:
    """A small GenerateRequest with raw output (a 4-step lighthouse, seed 11); ``fields`` replace any of it."""
    defaults: dict[str, object] = {"prompt": "a lighthouse", "num_inference_steps": 4, "seed": 11,
                                   "output_format": W.OUTPUT_FORMAT_RAW}
    return W.GenerateRequest(**{**defaults, **fields})


REQUEST = request()


def pixels(response: worker_pb2.GenerateResponse, index: int = 0) -> np.ndarray:
    """Image ``index`` of a worker's response as a (height, width, 3) uint8 array, raw or PNG alike."""
    image = response.images[index]
    if image.mime_type == "image/png":
        return np.asarray(Image.open(io.BytesIO(image.data)).convert("RGB"))
    return np.frombuffer(image.data, dtype=np.uint8).reshape(image.height, image.width, 3)


@dataclass
class CliResult:
    """What a ``diffusion`` command did: its exit code and what it printed."""

    returncode: int
    stdout: str
    stderr: str


def cli_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This process's environment without the DIFFUSION_* variables (but the model cache), plus ``extra``."""
    kept = {k: v for k, v in os.environ.items() if not k.startswith("DIFFUSION_") or k == "DIFFUSION_MODEL_CACHE"}
    return {**kept, **(extra or {})}


def cli_command(*args: str) -> list[str]:
    """The command line of ``diffusion *args`` as a process (run it with ``cli_env()``)."""
    return [sys.executable, "-m", "clients.cli", *args]


@contextlib.contextmanager
def _environment(environment: dict[str, str]) -> Iterator[None]:
    """os.environ is ``environment`` for the block."""
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(environment)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def cli(*args: str, env: dict[str, str] | None = None) -> CliResult:
    """Runs ``diffusion *args`` in this process (no interpreter to start), in an environment with no
    DIFFUSION_* variable but the model cache and ``env``; argparse's exits are its exit code.

    The tests that need the real process (a terminal, output read as it comes) start ``cli_command``."""
    out, err = io.StringIO(), io.StringIO()
    cli_module.stderr = cli_module._Stderr()  # a fresh progress bar, as in a new process
    with _environment(cli_env(env)), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = cli_module.main(list(args))
        except SystemExit as exit_:
            if isinstance(exit_.code, str):
                print(exit_.code, file=err)
            code = exit_.code if isinstance(exit_.code, int) else int(exit_.code is not None)
    return CliResult(code, out.getvalue(), err.getvalue())


def new_runner(log_dir: Path, runner_args: tuple[str, ...] = (), fake_step_s: float | None = None,
               target: str | None = None) -> ServiceProcess:
    """A real runner with ``runner_args``, or the fake runner process when ``fake_step_s`` is set
    (each step takes that long), at ``target`` (a free port by default)."""
    if fake_step_s is not None:
        return start_fake_runner(log_dir, fake_step_s, target=target)
    return start_runner(log_dir, *runner_args, target=target)


@dataclass
class Pair:
    """A runner and a worker serving from it (see ``new_runner`` for ``runner_args`` and ``fake_step_s``).

    ``http_port``/``metrics_port``: the worker's OpenAI-compatible API and metrics ports, where it
    serves them. ``owns_runner``: false where the worker was started on a runner shared with other
    modules, which ``stop`` leaves running."""

    log_dir: Path
    runner: ServiceProcess
    worker: ServiceProcess
    runner_args: tuple[str, ...] = ()
    fake_step_s: float | None = None
    http_port: int | None = None
    metrics_port: int | None = None
    owns_runner: bool = True

    @property
    def base_url(self) -> str:
        """The worker's OpenAI-compatible API, as the OpenAI SDK takes it (``http=True``)."""
        if self.http_port is None:
            raise AttributeError("this pair's worker serves no HTTP API: start it with http=True")
        return f"http://127.0.0.1:{self.http_port}/v1"

    @property
    def metrics_url(self) -> str:
        """The worker's Prometheus endpoint (``metrics=True``)."""
        if self.metrics_port is None:
            raise AttributeError("this pair's worker serves no metrics: start it with metrics=True")
        return f"http://127.0.0.1:{self.metrics_port}/metrics"

    def restart_runner(self, signum: int = signal.SIGTERM) -> None:
        """Stops the runner with ``signum`` and starts a new one like it at its address."""
        if not self.owns_runner:
            raise RuntimeError("the runner is shared with other modules: start a pair of its own to restart it")
        target = self.runner.target
        self.runner.stop(signum)
        self.runner = new_runner(self.log_dir, self.runner_args, self.fake_step_s, target)

    def stop(self) -> None:
        self.worker.stop()
        if self.owns_runner:
            self.runner.stop()


def start_pair(log_dir: Path, *worker_args: str, runner_args: tuple[str, ...] = (),
               fake_step_s: float | None = None, on: ServiceProcess | None = None, http: bool = False,
               metrics: bool = False, ready: bool = True) -> Pair:
    """Starts a runner (see ``new_runner``) and a worker with ``worker_args`` on it; ``ready``: waits
    until the worker is. The worker serves ``tiny``, the suite's fast model, unless ``worker_args``
    give another ``--model`` (the last one counts).

    ``on``: the worker runs on that runner, started elsewhere (shared), and no runner is started.
    ``http``/``metrics``: the worker serves its OpenAI-compatible API/its metrics on a reserved port
    (``Pair.base_url``, ``Pair.metrics_url``); both are off otherwise."""
    http_port = free_port() if http else None
    metrics_port = free_port() if metrics else None
    ports = [*(("--http-port", str(http_port)) if http_port else ()),
             *(("--metrics-port", str(metrics_port)) if metrics_port else ())]
    runner = on or new_runner(log_dir, runner_args, fake_step_s)
    try:
        worker = start_worker(log_dir, runner.target, "--model", "tiny", *worker_args, *ports, ready=ready)
    except BaseException:
        if on is None:
            runner.stop()
        raise
    return Pair(log_dir, runner, worker, runner_args, fake_step_s, http_port, metrics_port, owns_runner=on is None)


@contextlib.contextmanager
def running_pair(log_dir: Path, *worker_args: str, runner_args: tuple[str, ...] = (),
                 fake_step_s: float | None = None, ready: bool = True) -> Iterator[Pair]:
    """``start_pair`` for the block, both stopped after it."""
    pair = start_pair(log_dir, *worker_args, runner_args=runner_args, fake_step_s=fake_step_s, ready=ready)
    try:
        yield pair
    finally:
        pair.stop()
