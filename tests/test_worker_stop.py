"""Stopping the worker after its drain is bounded: a step that hangs is logged with the tasks'
stacks and left behind, so the process still exits (seen once: a worker that drained every request
and then never exited)."""

from __future__ import annotations

import asyncio
import logging
from types import SimpleNamespace
from typing import Any

import pytest

from worker_service.app import stop_serving

pytestmark = pytest.mark.unit


class Server:
    def __init__(self) -> None:
        self.stopped_with: float | None = None

    async def stop(self, grace: float) -> None:
        self.stopped_with = grace


class Pool:
    def __init__(self, hang: bool) -> None:
        self.hang = hang
        self.closed = False

    async def close(self, released: asyncio.Event) -> None:
        if self.hang:
            await released.wait()
        self.closed = True


async def stubborn(released: asyncio.Event) -> None:
    """A task that swallows its cancellation, as a bug in a finally block would (until ``released``)."""
    while not released.is_set():
        try:
            await released.wait()
        except asyncio.CancelledError:
            continue


def run_stop(tasks_of: Any, pool: Pool) -> tuple[bool, Server]:
    """``stop_serving`` of a worker whose steps are ``tasks_of(released)`` and ``pool``'s close. A hung
    step is left behind, as the worker leaves it before ``os._exit``; here ``released`` then ends it,
    so the loop closes with no task pending."""
    released = asyncio.Event()

    async def main() -> tuple[bool, Server]:
        server = Server()
        worker = SimpleNamespace(server=server, pool=SimpleNamespace(close=lambda: pool.close(released)))
        finished = await stop_serving(worker, None, tasks_of(released), step_timeout=0.2)  # type: ignore[arg-type]
        return finished, server

    async def release() -> None:
        released.set()
        await asyncio.gather(*(asyncio.all_tasks() - {asyncio.current_task()}))

    loop = asyncio.new_event_loop()
    try:
        return loop.run_until_complete(main())
    finally:
        loop.run_until_complete(release())
        loop.close()


def test_every_step_runs_and_a_clean_stop_says_so() -> None:
    pool = Pool(hang=False)
    finished, server = run_stop(lambda released: [asyncio.ensure_future(asyncio.Event().wait())], pool)
    assert finished and pool.closed and server.stopped_with is not None


def test_a_hanging_step_is_logged_and_the_later_steps_still_run(caplog: pytest.LogCaptureFixture) -> None:
    pool = Pool(hang=False)
    with caplog.at_level(logging.ERROR, logger="worker_service"):
        finished, _ = run_stop(lambda released: [asyncio.ensure_future(stubborn(released))], pool)
    assert not finished
    assert pool.closed  # the step after the hung one ran
    [record] = [r for r in caplog.records if "did not end" in r.getMessage()]
    assert "the dispatcher and idle sleep" in record.getMessage() and "stubborn" in record.getMessage()


def test_hanging_runner_channels_are_reported_by_name(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.ERROR, logger="worker_service"):
        finished, _ = run_stop(lambda released: [], Pool(hang=True))
    assert not finished
    assert any("stopping the runner channels did not end" in r.getMessage() for r in caplog.records)
