"""Session-scoped fixtures shared by the runner test modules (registered in conftest.py).

A runner process costs its torch and diffusers imports (seconds on a loaded machine), so the modules
that call a runner directly share one, and modules with the same worker flags share one pair. A
module that uses a shared process sets the state it needs when it starts (``LoadModel`` replaces
the model, its weights and its sleep state; a worker's ``Init`` does the same through the worker)
and leaves no adapter or sleeping component behind.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest

from diffusion.v1 import common_pb2, runner_pb2, runner_pb2_grpc, worker_pb2, worker_pb2_grpc
from harness.processes import ServiceProcess, start_runner, worker_stub
from runner_calls import execute, info, item, runner_stub
from serving_common.owned_dirs import lock_directory
from support import Pair, running_pair


@dataclass
class SharedRunner:
    """The runner process that the runner test modules call directly, and what it said before
    any model was loaded."""

    process: ServiceProcess
    base: Path  # its spill directory is base/"spill"
    stale: dict[str, Path]  # spill directories of other runners, in its TMPDIR when it started
    info_unloaded: common_pb2.RunnerInfo
    execute_unloaded: grpc.RpcError

    @property
    def target(self) -> str:
        return self.process.target

    def load(self, source: str) -> runner_pb2_grpc.RunnerServiceStub:
        """A stub to it with ``source`` loaded in place of whatever an earlier module left."""
        stub = runner_stub(self.target)
        stub.LoadModel(runner_pb2.LoadModelRequest(source=source), timeout=120)
        return stub


@pytest.fixture(scope="session")
def shared_runner(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SharedRunner]:
    """A runner with the default flags but its spill directory (base/"spill"), started with no model.

    Its TMPDIR holds the spill directories of a killed runner (no one holds its lock) and of a live
    one (this process holds its lock), for test_runner_hardening to check which it removed at start."""
    from runner_service.platforms.offload import SPILL_PREFIX  # torch: only where a runner is wanted

    base = tmp_path_factory.mktemp("shared-runner")
    tmp = base / "tmp"
    stale = {name: tmp / f"{SPILL_PREFIX}{name}" for name in ("killed", "live")}
    for directory in stale.values():
        directory.mkdir(parents=True)
        (directory / "unet.safetensors").write_bytes(b"weights of a runner")
    live = lock_directory(stale["live"])  # held while the runner starts
    assert live is not None
    try:
        process = start_runner(base, "--spill-dir", str(base / "spill"), env={"TMPDIR": str(tmp)})
    finally:
        os.close(live)
    try:
        stub = runner_stub(process.target)
        try:
            execute(stub, item())
        except grpc.RpcError as error:
            execute_unloaded = error
        else:
            raise AssertionError("a runner with no model executed")
        yield SharedRunner(process, base, stale, info(stub), execute_unloaded)
    finally:
        process.stop()


# The serial worker: one request runs, two queue, and image inputs hold SERIAL_INPUT_BYTES in all.
SERIAL_INPUT_BYTES = 250_000


@pytest.fixture(scope="session")
def serial_pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    """A worker serving tiny one request at a time (--max-batch-size 1), with --max-queue 2 and
    --max-input-bytes SERIAL_INPUT_BYTES: for the tests that hold one request in flight and queue
    others behind it (test_image_inputs' bounds, test_adapters' unloading)."""
    with running_pair(tmp_path_factory.mktemp("serial-pair"), "--max-queue", "2", "--max-batch-size", "1",
                      "--max-input-bytes", str(SERIAL_INPUT_BYTES)) as pair:
        yield pair


@pytest.fixture(scope="session")
def serial_stub(serial_pair: Pair) -> Iterator[worker_pb2_grpc.WorkerServiceStub]:
    """A warmed WorkerService stub to ``serial_pair``'s worker."""
    with worker_stub(serial_pair.worker.target) as stub:
        yield stub


# The tiny UNet is 3.17 MB, its VAE 1.49 MB: two pushes of the UNet fit under the weights pair's
# --max-pushed-bytes (the one kept and the one replacing it), two of both do not.
MAX_PUSHED_BYTES = 8_000_000


def weights_worker_args(directory: Path) -> tuple[str, ...]:
    """The weights pair's worker flags: its pushes kept in directory/"pushes", under MAX_PUSHED_BYTES,
    and its state in directory/"state.json"."""
    return ("--push-dir", str(directory / "pushes"), "--state-file", str(directory / "state.json"),
            "--max-pushed-bytes", str(MAX_PUSHED_BYTES))


@pytest.fixture(scope="session")
def weights_pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    """A worker with ``weights_worker_args(log_dir)`` on a runner holding at most 2 adapters
    (--max-adapters 2): for the modules that change weights and adapters (test_adapters,
    test_push_weights). Each starts from tiny as built (Init); a test may restart either process
    at its address."""
    directory = tmp_path_factory.mktemp("weights-pair")
    with running_pair(directory, *weights_worker_args(directory), runner_args=("--max-adapters", "2")) as pair:
        yield pair


@pytest.fixture(scope="session")
def weights_stub(weights_pair: Pair) -> Iterator[worker_pb2_grpc.WorkerServiceStub]:
    """A warmed WorkerService stub to ``weights_pair``'s worker."""
    with worker_stub(weights_pair.worker.target) as stub:
        yield stub


def serve_tiny_as_built(stub: worker_pb2_grpc.WorkerServiceStub) -> None:
    """The weights pair serving tiny as built, as a module using it starts: an Init of tiny, unless
    the pair serves it so already (ready and awake, no adapter, no weight update on any runner), as
    the pair's start and a module that passed leave it."""
    status = stub.GetStatus(worker_pb2.GetStatusRequest(), timeout=10)
    if not (status.state == worker_pb2.WORKER_STATE_READY and status.sleep_level == 0
            and status.model.source == "tiny" and not status.adapters and status.runners
            and all(runner.ready and not runner.info.weight_updates for runner in status.runners)):
        stub.Init(worker_pb2.InitRequest(model="tiny"), timeout=120)


@pytest.fixture(scope="module")
def cpu_platform(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A CPU platform for a module's in-process model (its spill files and temporary files in the
    module's own directories)."""
    from runner_service.platforms.cpu import CpuPlatform  # torch: only for the modules that ask

    tempfile.tempdir, before = str(tmp_path_factory.mktemp("tmp")), tempfile.tempdir
    platform = CpuPlatform(tmp_path_factory.mktemp("spill"))
    yield platform
    platform.offload_store().close()
    tempfile.tempdir = before
