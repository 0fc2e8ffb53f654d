"""The asyncio client of ``diffusion.v1.WorkerService``: ``DiffusionClient`` with ``await``.

    async with AsyncDiffusionClient("127.0.0.1:50051") as client:
        async for event in client.stream("a red fox", steps=10):
            ...
        video = await client.generate_video("a red fox running", num_frames=9)   # on a video model

Create it inside the running event loop. A failed call raises the same ``clients.errors`` types as
``clients.client``.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from typing import Any, TypeVar, cast

import grpc
from google.protobuf.message import Message
from grpc_health.v1 import health_pb2

from clients import types
from clients.calls import AwaitedCalls, Call
from clients.errors import raises_typed_errors, typed_errors
from clients.types import Event, Progress, VideoProgressCallback, VideoResult
from diffusion.v1 import worker_pb2
from serving_common.protocol import WORKER_SERVICE

R = TypeVar("R")


class AsyncEventStream:
    """The events of one GenerateStream call: an async iterator that can be cancelled (see ``EventStream``)."""

    def __init__(self, call: grpc.aio.UnaryStreamCall[worker_pb2.GenerateStreamRequest,
                                                      worker_pb2.GenerateStreamResponse]) -> None:
        self._call = call
        self._responses = call.__aiter__()
        self._reader = types.StreamReader()

    def __aiter__(self) -> AsyncIterator[Event]:
        return self

    async def __anext__(self) -> Event:
        with typed_errors():
            return self._reader.event(await self._responses.__anext__())

    def cancel(self) -> None:
        self._call.cancel()

    async def __aenter__(self) -> AsyncEventStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.cancel()


async def _in_thread(requests: Iterator[Message] | Iterator[bytes]) -> AsyncIterator[object]:
    """A client stream's ``requests`` (PushWeights') advanced in a thread: reading and hashing
    tensors would stall the event loop."""
    while (request := await asyncio.to_thread(next, requests, None)) is not None:
        yield request


@raises_typed_errors
class AsyncDiffusionClient(AwaitedCalls[AsyncEventStream]):
    """An asyncio client of one worker; use it with ``async with`` or ``await close()``.

    Its calls are ``clients.calls.WorkerCalls``'s, as coroutines; ``generate_video`` and
    ``wait_ready`` are its own."""

    grpc_module = grpc.aio

    async def _call(self, call: Call[R]) -> R:
        request = call.request if isinstance(call.request, Message) else _in_thread(call.request)
        return call.result(await self._rpc(call)(request, **self._options(call.timeout)))

    def _events(self, request: worker_pb2.GenerateRequest, timeout: float | None) -> AsyncEventStream:
        return AsyncEventStream(self._stub.GenerateStream(
            worker_pb2.GenerateStreamRequest(request=request), **self._options(timeout)))

    async def generate_video(self, prompt: str, *, on_progress: VideoProgressCallback | None = None,
                             timeout: float | None = None, **options: Any) -> VideoResult:
        """See ``DiffusionClient.generate_video``; ``on_progress`` is called in the event loop.
        Cancelling the awaiting task cancels the request."""
        async with self.stream_video(prompt, timeout=timeout, **options) as stream:
            async for event in stream:
                if isinstance(event, Progress) and on_progress is not None:
                    on_progress(event.phase, event.step, event.total)
                elif isinstance(event, types.Done):
                    return event.result.video()
        raise types.malformed("the stream ended without its result")

    async def wait_ready(self, service: str = WORKER_SERVICE, *, timeout: float | None = None) -> None:
        """See ``DiffusionClient.wait_ready``."""
        deadline = self._deadline(timeout)
        while True:  # each watch until SERVING, or until the worker goes away (a restart)
            with self._health_watch(service, deadline) as watch:
                async for response in watch:
                    if response.status == health_pb2.HealthCheckResponse.SERVING:
                        return

    async def close(self) -> None:
        await cast(grpc.aio.Channel, self._channel).close()  # grpc_module is grpc.aio

    async def __aenter__(self) -> AsyncDiffusionClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
