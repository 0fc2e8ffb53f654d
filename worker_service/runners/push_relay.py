"""One runner's PushWeights call, fed chunk by chunk while a client's PushWeights stream arrives."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from diffusion.v1 import runner_pb2
from worker_service.runners.handle import RunnerHandle


class PushRelay:
    """One runner's PushWeights call, fed chunk by chunk while the client's stream arrives."""

    def __init__(self, runner: RunnerHandle, timeout: float | None) -> None:
        self.runner = runner
        # A few chunks in flight per runner: the client's stream moves at the pace of the slowest.
        self._queue: asyncio.Queue[bytes | None] = asyncio.Queue(maxsize=8)
        self._call = runner.push_serialized(self._messages(), timeout=timeout)
        self._result = asyncio.ensure_future(runner.call(self._call))

    async def _messages(self) -> AsyncIterator[bytes]:
        while (message := await self._queue.get()) is not None:
            yield message

    async def send(self, message: bytes | None) -> None:
        """Queues a serialized message (None ends the stream), unless this runner's call has ended:
        it is then left for re-apply, and the others go on."""
        if not self._queue.full() and not self._result.done():
            self._queue.put_nowait(message)
            return
        while not self._result.done():
            try:
                async with asyncio.timeout(1.0):
                    await self._queue.put(message)
                return
            except TimeoutError:
                continue

    async def commit(self, commit: bytes) -> runner_pb2.RunnerServicePushWeightsResponse:
        await self.send(commit)
        await self.send(None)
        reply: runner_pb2.RunnerServicePushWeightsResponse = await self._result
        return reply

    def abandon(self) -> None:
        """Ends the call without a commit if it is still open: the runner applies nothing. A call
        that already ended (the runner refused, or its deadline passed) still has gRPC's task
        reading ``_messages``: the end of the stream lets it finish, rather than stay pending
        until it is garbage ("Task was destroyed but it is pending")."""
        if not self._result.done():
            self._call.cancel()
        elif not self._queue.full():
            self._queue.put_nowait(None)
        self._result.add_done_callback(lambda task: task.cancelled() or task.exception())
