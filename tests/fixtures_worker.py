"""Session-scoped fixtures shared by the worker test modules (registered in conftest.py).

``real_runner``: the runner test modules' session runner (``shared_runner`` of fixtures_runner.py),
for worker modules whose worker may change its state: the worker's Init at start loads tiny on it,
and the module leaves it serving tiny, awake, without adapters.

``tiny_pair``/``tiny_stub``: one real runner and one worker serving ``tiny`` with the default flags,
for the whole run. Send it requests (Generate, GetStatus, Cancel, the CLI, the HTTP API off), never
change its state: a module that sleeps, loads weights or adapters, switches models, or freezes or
kills a process starts its own pair (``support.start_pair``/``running_pair``), the fake runner where
the behaviour under test is the worker's. ``fake_pair`` starts such pairs for one test.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from diffusion.v1 import worker_pb2_grpc
from harness.processes import ServiceProcess, worker_stub
from support import Pair, start_pair


@pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    """A real runner and a worker serving tiny with the default flags, shared by every module."""
    pair = start_pair(tmp_path_factory.mktemp("tiny-pair"))
    yield pair
    pair.stop()


@pytest.fixture(scope="session")
def tiny_stub(tiny_pair: Pair) -> Iterator[worker_pb2_grpc.WorkerServiceStub]:
    """A WorkerService stub to ``tiny_pair``'s worker, warmed by a first 1-step request."""
    with worker_stub(tiny_pair.worker.target) as stub:
        yield stub


@pytest.fixture
def fake_pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., Pair]]:
    """Starts pairs for one test: ``fake_pair(*worker_args, step_s=0.01, ready=True)`` gives a fake
    runner process whose steps take ``step_s`` and a worker with ``worker_args`` on it; all are
    stopped after the test."""
    pairs: list[Pair] = []

    def start(*worker_args: str, step_s: float = 0.01, ready: bool = True) -> Pair:
        pairs.append(start_pair(tmp_path_factory.mktemp("fake-pair"), *worker_args, fake_step_s=step_s, ready=ready))
        return pairs[-1]

    yield start
    for pair in pairs:
        pair.stop()



@pytest.fixture(scope="session")
def real_runner(shared_runner: Any) -> ServiceProcess:
    """The runner test modules' session runner process, for worker modules that change its state
    (see the module docstring)."""
    process: ServiceProcess = shared_runner.process
    return process
