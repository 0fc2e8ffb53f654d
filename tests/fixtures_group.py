"""A runner group served through the worker, beside one device serving the same model, for the group
test modules (registered in conftest.py): ``test_group_served`` (what the group computes) and
``test_group_faults`` (a rank lost or failing), two modules so two test workers share their time.

``single``: a worker on one single-device runner serving tiny Flux. ``group``: a worker with
``--cfg-parallel`` on a ``--devices 2`` runner (two gloo ranks) at a fixed target, so a new group can
take its place after one ends. Both are module-scoped: each module gets its own. Beside them, the
modules' requests (``ask``) and what they read of a group (``status``, ``rank_1_pid``) or do to
rank 1 (``cap_address_space``).
"""

from __future__ import annotations

import re
import resource
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np
import pytest

from diffusion.v1 import common_pb2, worker_pb2_grpc
from diffusion.v1 import worker_pb2 as W
from harness.processes import ServiceProcess, free_port, start_runner, start_worker
from support import pixels, request

MODEL = "tiny-flux"
GROUP_ARGS = ("--devices", "2", "--threads", "1")
CFG = common_pb2.Parallelism(cfg=True)
ULYSSES = common_pb2.Parallelism(ulysses_degree=2)
# Tiny Flux at 32x32: with Ulysses-2 its image tokens split evenly over the two ranks.
SIZE = 32


def ask(request_id: str, guided: bool, steps: int = 2, **fields: object) -> W.GenerateRequest:
    """A tiny Flux request; ``guided``: true CFG (a negative prompt and true_cfg_scale 3), so both
    guidance branches run each step."""
    extra = {"negative_prompt": "blurry", "true_cfg_scale": 3.0} if guided else {}
    return request(**{"request_id": request_id, "prompt": "a red circle", "width": SIZE, "height": SIZE,
                      "num_inference_steps": steps, "seed": 5, **extra, **fields})


@dataclass
class Served:
    """A worker on one runner at a fixed target (so a new runner can take its place) and its stub."""

    log_dir: Path
    runner: ServiceProcess
    worker: ServiceProcess
    stub: worker_pb2_grpc.WorkerServiceStub


@pytest.fixture(scope="module")
def single(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    log_dir = tmp_path_factory.mktemp("single")
    runner = start_runner(log_dir, "--threads", "1")
    worker = start_worker(log_dir, runner.target, "--model", MODEL)
    with grpc.insecure_channel(worker.target) as channel:
        yield Served(log_dir, runner, worker, worker_pb2_grpc.WorkerServiceStub(channel))
    worker.stop()
    runner.stop()


@pytest.fixture(scope="module")
def group(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    log_dir = tmp_path_factory.mktemp("group")
    target = f"127.0.0.1:{free_port()}"
    # A spill directory given: each rank spills (sleep level 1 on CPU) into its own part of it.
    runner = start_runner(log_dir, *GROUP_ARGS, "--spill-dir", str(log_dir / "spill"), target=target)
    worker = start_worker(log_dir, runner.target, "--model", MODEL, "--cfg-parallel")
    served = Served(log_dir, runner, worker, worker_pb2_grpc.WorkerServiceStub(grpc.insecure_channel(worker.target)))
    yield served
    served.worker.stop()
    served.runner.stop()


def status(served: Served) -> W.GetStatusResponse:
    return served.stub.GetStatus(W.GetStatusRequest(), timeout=10)


def max_difference(first: W.GenerateResponse, second: W.GenerateResponse) -> int:
    return int(np.abs(pixels(first).astype(int) - pixels(second).astype(int)).max())


def cap_address_space(pid: int) -> tuple[int, int]:
    """Caps process ``pid``'s address space at what it maps now (as a container's memory limit
    would stop it growing); returns the limits it had."""
    held = resource.prlimit(pid, resource.RLIMIT_AS)
    status = Path(f"/proc/{pid}/status").read_text()
    size = int(re.findall(r"VmSize:\s+(\d+) kB", status)[0]) * 1024
    resource.prlimit(pid, resource.RLIMIT_AS, (size, held[1]))
    return held


def rank_1_pid(served: Served) -> int:
    return int(re.findall(r"rank 1 of 2 on cpu: pid (\d+)", served.runner.log())[-1])
