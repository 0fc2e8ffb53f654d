"""An operation on every runner at once: the one place its failures are handled.

The operation holds the execution gate exclusively (no batch executes meanwhile, so weights never
change under a request) and goes to every reachable runner together; each runner's handle sorts its
own call's failure (``on_call_outcome``), and after a real failure the desired state follows what the
runners really hold (``after_failure``, the controller's). An operation that may change what the
runners output tells ``on_change`` once it holds the gate (the result cache drops every entry).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

import grpc

from serving_common.errors import ServiceError, unavailable
from worker_service.runners import RunnerHandle, RunnerPool
from worker_service.runners.gate import ExecutionGate

T = TypeVar("T")


class FanOut:
    """Runs operations on every reachable runner of ``pool``; ``refresh`` publishes the lifecycle state
    once one ends, ``after_failure`` brings the desired state to what the runners hold after one failed,
    ``on_change`` hears of each operation that may change what they output, before it does."""

    def __init__(self, pool: RunnerPool, gate: ExecutionGate, refresh: Callable[[], Awaitable[None]],
                 after_failure: Callable[[list[RunnerHandle]], Awaitable[None]],
                 on_change: Callable[[], None] = lambda: None) -> None:
        self._pool = pool
        self._gate = gate
        self._refresh = refresh
        self._after_failure = after_failure
        self._on_change = on_change

    @contextlib.asynccontextmanager
    async def exclusive(self, changes_outputs: bool = True) -> AsyncIterator[None]:
        """Holds the gate exclusively; the lifecycle state is published once the operation ends.
        ``changes_outputs``: the operation may change what the runners output (all but a level-1
        Sleep or WakeUp): ``on_change`` is told once no batch runs, before anything changes."""
        try:
            async with self._gate.exclusive():
                if changes_outputs:
                    self._on_change()
                yield
        finally:
            await self._refresh()

    async def on_all(self, work: Callable[[RunnerHandle], Awaitable[T]], changes_state: bool = True,
                      targets: list[RunnerHandle] | None = None) -> list[tuple[RunnerHandle, T]]:
        """Runs ``work`` on every reachable runner (or ``targets``) at once. A runner that turns out
        unreachable is left for re-apply (when another succeeded); any other failure is raised.

        An operation that ``changes_state`` changes the desired state: the runners it does not
        reach no longer hold it, and get it again when they may. A runner whose outcome is unknown
        (the call timed out or was cancelled, so the operation may still be running there) gets no
        work until the desired state, which the failed operation did not change, has been applied
        again. Nothing a caller was told failed takes effect later."""
        targets = self._pool.reachable() if targets is None else targets
        if not targets:
            raise unavailable(f"no runner can be reached ({self._pool.describe()})")
        if changes_state:
            for runner in self._pool.runners:
                if runner not in targets:
                    runner.missed()
        try:
            results = await asyncio.gather(*(work(r) for r in targets), return_exceptions=True)
        except BaseException:  # the caller went away (its deadline passed): every outcome is unknown
            self._outcomes_unknown(targets, changes_state)
            raise
        done: list[tuple[RunnerHandle, T]] = []
        failures: list[ServiceError] = []
        for runner, result in zip(targets, results, strict=True):
            if isinstance(result, ServiceError):
                failures.append(result)  # its handle sorted it already
            elif isinstance(result, BaseException):
                self._outcomes_unknown(targets, changes_state)
                raise result
            else:
                done.append((runner, result))
        real = [f for f in failures if f.code != grpc.StatusCode.UNAVAILABLE]
        if real or not done:
            await self._after_failure(targets)
            raise (real or failures)[0]
        return done

    @staticmethod
    def _outcomes_unknown(runners: list[RunnerHandle], changes_state: bool) -> None:
        if changes_state:
            for runner in runners:
                runner.on_call_outcome(grpc.StatusCode.CANCELLED, changes_state=True)

