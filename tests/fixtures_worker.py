"""Fixtures shared by the worker test modules (registered in conftest.py).

``serve``: the module's own pairs. ``serve(*worker_args, runner_args=(), fake_step_s=None, on=None,
http=False, metrics=False, ready=True)`` starts a runner and a worker serving tiny with
``worker_args`` (``support.start_pair`` says what each keyword does; ``on=<runner>`` starts only a
worker, on a runner shared with other modules) and stops what it started after the module. A module
declares its ``pair`` with it; ``stub`` is then a warmed WorkerService stub to that pair's worker.
``fake_pair`` is the same factory for one test, on the fake runner process unless told otherwise.

``real_runner``: the runner test modules' session runner (``shared_runner`` of fixtures_runner.py),
for worker modules whose worker may change its state (``serve(..., on=real_runner)``): the worker's
Init at start loads tiny on it, and the module leaves it serving tiny, awake, without adapters.

``tiny_pair``/``tiny_stub``: one real runner and one worker serving ``tiny`` with the default flags,
for the whole run. Send it requests (Generate, GetStatus, Cancel, the CLI, the HTTP API off), never
change its state: a module that sleeps, loads weights or adapters, switches models, or freezes or
kills a process starts its own pair (``serve``), the fake runner where the behaviour under test is
the worker's.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from diffusion.v1 import worker_pb2_grpc
from harness.processes import ServiceProcess, worker_stub
from support import Pair, start_pair


class PairsStarted:
    """Starts pairs, each with a log directory of its own, and stops them all at ``close``."""

    def __init__(self, tmp_path_factory: pytest.TempPathFactory, name: str) -> None:
        self.tmp_path_factory = tmp_path_factory
        self.name = name
        self.pairs: list[Pair] = []

    def __call__(self, *worker_args: str, runner_args: tuple[str, ...] = (), fake_step_s: float | None = None,
                 on: ServiceProcess | None = None, http: bool = False, metrics: bool = False,
                 ready: bool = True) -> Pair:
        self.pairs.append(start_pair(self.tmp_path_factory.mktemp(self.name), *worker_args, runner_args=runner_args,
                                     fake_step_s=fake_step_s, on=on, http=http, metrics=metrics, ready=ready))
        return self.pairs[-1]

    def close(self) -> None:
        for pair in reversed(self.pairs):
            pair.stop()


@pytest.fixture(scope="module")
def serve(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[PairsStarted]:
    """Starts pairs for the module (see the module docstring); all are stopped after it."""
    started = PairsStarted(tmp_path_factory, request.module.__name__.rpartition(".")[2])
    yield started
    started.close()


@pytest.fixture
def fake_pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., Pair]]:
    """``serve`` for one test, on the fake runner process whose steps take ``fake_step_s`` (0.01 s
    unless told); all are stopped after the test."""
    started = PairsStarted(tmp_path_factory, "fake-pair")
    yield functools.partial(started, fake_step_s=0.01)
    started.close()


@pytest.fixture(scope="module")
def stub(pair: Pair) -> Iterator[worker_pb2_grpc.WorkerServiceStub]:
    """A WorkerService stub to the module's ``pair`` fixture's worker, warmed by a first 1-step request."""
    with worker_stub(pair.worker.target) as opened:
        yield opened


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


@pytest.fixture(scope="session")
def real_runner(shared_runner: Any) -> ServiceProcess:
    """The runner test modules' session runner process, for worker modules that change its state
    (see the module docstring)."""
    process: ServiceProcess = shared_runner.process
    return process
