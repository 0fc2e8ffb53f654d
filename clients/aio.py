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
import time
from collections.abc import AsyncIterator, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, cast

import grpc
from grpc_health.v1 import health_pb2

from clients import push, types
from clients.connection import ClientBase
from clients.errors import raises_typed_errors, typed_errors
from clients.push import ProgressCallback, Weights
from clients.types import Event, GenerateResult, Progress, PushResult, VideoProgressCallback, VideoResult
from diffusion.v1 import common_pb2, worker_pb2
from serving_common.protocol import WORKER_SERVICE
from serving_common.tensor_stream import DEFAULT_CHUNK_BYTES


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


async def _in_thread(requests: Iterator[worker_pb2.PushWeightsRequest]
                     ) -> AsyncIterator[worker_pb2.PushWeightsRequest]:
    """``requests`` advanced in a thread: reading and hashing tensors would stall the event loop."""
    while (request := await asyncio.to_thread(next, requests, None)) is not None:
        yield request


@raises_typed_errors
class AsyncDiffusionClient(ClientBase):
    """An asyncio client of one worker; use it with ``async with`` or ``await close()``."""

    grpc_module = grpc.aio

    async def generate(self, prompt: str, *, timeout: float | None = None, **options: Any) -> GenerateResult:
        """Generates images and returns them when all are done (None: the worker's default).

        ``options`` are those of ``clients.types.build_generate_request`` (None: the worker's default).
        """
        request = types.build_generate_request(prompt, **options)
        response = await self._stub.Generate(request, **self._options(timeout))
        return GenerateResult.from_proto(response)

    def stream(self, prompt: str, *, timeout: float | None = None, **options: Any) -> AsyncEventStream:
        """Like ``generate``, but yields Queued, Started and Progress events before Done.

        ``options`` are those of ``clients.types.build_generate_request`` (None: the worker's default).
        """
        return self._stream(types.build_generate_request(prompt, **options), timeout)

    def _stream(self, request: worker_pb2.GenerateRequest, timeout: float | None) -> AsyncEventStream:
        call = self._stub.GenerateStream(
            worker_pb2.GenerateStreamRequest(request=request), **self._options(timeout))
        return AsyncEventStream(call)

    def stream_video(self, prompt: str, *, timeout: float | None = None, **options: Any) -> AsyncEventStream:
        """See ``DiffusionClient.stream_video``."""
        return self._stream(types.build_video_request(prompt, **options), timeout)

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

    async def cancel(self, request_id: str, *, timeout: float | None = None) -> str:
        """Cancels a queued or running request; returns where it was ("queued" or "running")."""
        response: worker_pb2.CancelResponse = await self._stub.Cancel(
            worker_pb2.CancelRequest(request_id=request_id), **self._options(timeout))
        return response.was

    async def status(self, *, timeout: float | None = None) -> worker_pb2.GetStatusResponse:
        response: worker_pb2.GetStatusResponse = await self._stub.GetStatus(
            worker_pb2.GetStatusRequest(), **self._options(timeout))
        return response

    async def init(self, model: str, dtype: str | int | None = None, *,
                   acceleration: common_pb2.Acceleration | Mapping[str, Any] | None = None,
                   parallel: common_pb2.Parallelism | Mapping[str, Any] | None = None,
                   timeout: float | None = None) -> worker_pb2.InitResponse:
        response: worker_pb2.InitResponse = await self._stub.Init(
            types.build_init_request(model, dtype, acceleration, parallel), **self._options(timeout))
        return response

    async def sleep(self, level: int = 1, tags: Iterable[str] = (), *,
                    timeout: float | None = None) -> worker_pb2.SleepResponse:
        response: worker_pb2.SleepResponse = await self._stub.Sleep(
            types.build_sleep_request(level, tags), **self._options(timeout))
        return response

    async def wake(self, tags: Iterable[str] = (), *,
                   timeout: float | None = None) -> worker_pb2.WakeUpResponse:
        response: worker_pb2.WakeUpResponse = await self._stub.WakeUp(
            types.build_wake_request(tags), **self._options(timeout))
        return response

    async def load_weights(self, path: str, *,
                           timeout: float | None = None) -> worker_pb2.LoadWeightsResponse:
        response: worker_pb2.LoadWeightsResponse = await self._stub.LoadWeights(
            worker_pb2.LoadWeightsRequest(path=path), **self._options(timeout))
        return response

    async def push_weights(self, weights: Weights, *, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                           on_progress: ProgressCallback | None = None,
                           timeout: float | None = None) -> PushResult:
        """See ``DiffusionClient.push_weights``; the stream is read and ``on_progress`` called in a thread."""
        requests = push.push_requests(weights, chunk_bytes, on_progress)
        return PushResult.from_proto(await self._stub.PushWeights(_in_thread(requests), **self._options(timeout)))

    async def weights_checksum(self, *, timeout: float | None = None) -> worker_pb2.GetWeightsChecksumResponse:
        response: worker_pb2.GetWeightsChecksumResponse = await self._stub.GetWeightsChecksum(
            worker_pb2.GetWeightsChecksumRequest(), **self._options(timeout))
        return response

    async def load_adapter(self, name: str, path: str | Path, *, pin: bool = False,
                           timeout: float | None = None) -> common_pb2.AdapterInfo:
        request = worker_pb2.LoadAdapterRequest(name=name, path=str(path), pin=pin)
        response: worker_pb2.LoadAdapterResponse = await self._stub.LoadAdapter(request, **self._options(timeout))
        return response.adapter

    async def unload_adapter(self, name: str, *, timeout: float | None = None) -> None:
        await self._stub.UnloadAdapter(worker_pb2.UnloadAdapterRequest(name=name), **self._options(timeout))

    async def list_adapters(self, *, timeout: float | None = None) -> worker_pb2.ListAdaptersResponse:
        response: worker_pb2.ListAdaptersResponse = await self._stub.ListAdapters(
            worker_pb2.ListAdaptersRequest(), **self._options(timeout))
        return response

    async def health(self, service: str = WORKER_SERVICE, *, timeout: float | None = None) -> str:
        response = await self._health.Check(health_pb2.HealthCheckRequest(service=service),
                                            **self._options(timeout))
        return types.health_name(response)

    async def wait_ready(self, service: str = WORKER_SERVICE, *, timeout: float | None = None) -> None:
        """See ``DiffusionClient.wait_ready``."""
        deadline = None if (limit := self._options(timeout)["timeout"]) is None else time.monotonic() + limit
        while True:
            remaining = None if deadline is None else max(deadline - time.monotonic(), 0.0)
            watch = self._health.Watch(health_pb2.HealthCheckRequest(service=service), wait_for_ready=True,
                                       timeout=remaining, metadata=self._metadata)
            try:
                async for response in watch:
                    if response.status == health_pb2.HealthCheckResponse.SERVING:
                        return
            except grpc.RpcError as error:
                if error.code() != grpc.StatusCode.UNAVAILABLE:
                    raise
            finally:
                watch.cancel()

    async def close(self) -> None:
        await cast(grpc.aio.Channel, self._channel).close()  # grpc_module is grpc.aio

    async def __aenter__(self) -> AsyncDiffusionClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
