"""The one gate between operations on the runners and the executions running on them.

Two kinds of operation take it, one at a time:

- ``exclusive()``: an operation on every runner (Init, Sleep, LoadWeights, ...). No execution
  starts once it asks, and it begins when the executions running now have ended, so weights
  never change under a request.
- ``serialized()``: an operation on one runner that gets no work meanwhile (bringing it to the
  desired state, removing it from the pool): it waits for other operations, not for executions,
  so the other runners keep serving.

The dispatcher reports each execution's start and end, and starts none while ``paused``.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable


class ExecutionGate:
    def __init__(self, on_open: Callable[[], None]) -> None:
        """``on_open`` is called whenever an exclusive operation has ended: executions may start."""
        self._on_open = on_open
        self._lock = asyncio.Lock()
        self._exclusive = 0  # exclusive operations waiting for the gate or holding it
        self._executing = 0
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def paused(self) -> bool:
        """No execution may start: an exclusive operation waits or runs."""
        return self._exclusive > 0

    @property
    def busy(self) -> bool:
        """An operation holds the gate."""
        return self._lock.locked()

    def execution_started(self) -> None:
        self._executing += 1
        self._idle.clear()

    def execution_finished(self) -> None:
        self._executing -= 1
        if self._executing == 0:
            self._idle.set()

    @contextlib.asynccontextmanager
    async def exclusive(self) -> AsyncIterator[None]:
        """Holds the gate with every execution ended and none starting."""
        self._exclusive += 1
        try:
            async with self._lock:
                await self._idle.wait()
                yield
        finally:
            self._exclusive -= 1
            self._on_open()

    @contextlib.asynccontextmanager
    async def serialized(self) -> AsyncIterator[None]:
        """Holds the gate against other operations; executions go on."""
        async with self._lock:
            yield
