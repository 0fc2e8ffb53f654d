"""The synchronous client of ``diffusion.v1.WorkerService``.

    with DiffusionClient("127.0.0.1:50051") as client:
        result = client.generate("a red fox", seed=7)
        result.images[0].to_pil().save("fox.png")
        video = client.generate_video("a red fox running", num_frames=9)   # on a video model

A failed call raises a ``clients.errors.DiffusionError`` subclass per status (``InvalidArgument``
with its ``violations``, ``ResourceExhausted`` with its ``retry_after``, ``Unavailable``, ...),
each also a ``grpc.RpcError``. ``timeout`` (seconds) is a deadline per call; a method's own
``timeout`` overrides the client's. Targets are ``host:port`` or ``unix:/path``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, TypeVar

import grpc
from grpc_health.v1 import health_pb2

from clients import types
from clients.calls import BlockingCalls, Call
from clients.errors import raises_typed_errors, typed_errors
from clients.types import Event, Progress, VideoProgressCallback, VideoResult
from diffusion.v1 import worker_pb2
from serving_common.protocol import WORKER_SERVICE

R = TypeVar("R")


class EventStream:
    """The events of one GenerateStream call: an iterator that can be cancelled.

    Iterating yields Queued, Started, Progress, a video's Chunks and finally Done (with whole videos:
    ``types.StreamReader``); a failed call raises its ``DiffusionError``. Leaving a ``with`` block
    or ``cancel()`` cancels the RPC, which cancels the request on the worker.
    """

    def __init__(self, call: grpc.Call) -> None:
        self._call = call
        self._reader = types.StreamReader()

    def __iter__(self) -> Iterator[Event]:
        return self

    def __next__(self) -> Event:
        with typed_errors():
            return self._reader.event(next(self._call))  # type: ignore[call-overload]

    def cancel(self) -> None:
        self._call.cancel()

    def __enter__(self) -> EventStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.cancel()


@raises_typed_errors
class DiffusionClient(BlockingCalls[EventStream]):
    """A blocking client of one worker; use it as a context manager or call ``close()``.

    Its calls are ``clients.calls.WorkerCalls``'s, made blocking; ``generate_video`` and
    ``wait_ready`` are its own."""

    grpc_module = grpc

    def _call(self, call: Call[R]) -> R:
        return call.result(self._rpc(call)(call.request, **self._options(call.timeout)))

    def _events(self, request: worker_pb2.GenerateRequest, timeout: float | None) -> EventStream:
        return EventStream(self._stub.GenerateStream(
            worker_pb2.GenerateStreamRequest(request=request), **self._options(timeout)))

    def generate_video(self, prompt: str, *, on_progress: VideoProgressCallback | None = None,
                       timeout: float | None = None, **options: Any) -> VideoResult:
        """Generates one video over GenerateStream (no message size limit) and returns it with its frames.

        ``options`` are those of ``clients.types.build_video_request`` (num_frames, fps, width,
        height, steps, guidance_scale, seed, negative_prompt, image, resize_mode, output_format, request_id).
        ``on_progress(phase, step, total)`` follows every step of "denoising", "decoding" and
        "encoding". Leaving early (an exception from ``on_progress``, Ctrl-C) cancels the request.
        """
        with self.stream_video(prompt, timeout=timeout, **options) as stream:
            for event in stream:
                if isinstance(event, Progress) and on_progress is not None:
                    on_progress(event.phase, event.step, event.total)
                elif isinstance(event, types.Done):
                    return event.result.video()
        raise types.malformed("the stream ended without its result")

    def wait_ready(self, service: str = WORKER_SERVICE, *, timeout: float | None = None) -> None:
        """Returns once ``service`` is SERVING: waits for the worker to listen, then watches its
        health (a model loading, a runner starting). ``DeadlineExceeded`` when ``timeout`` passes first."""
        deadline = self._deadline(timeout)
        while True:  # each watch until SERVING, or until the worker goes away (a restart)
            with self._health_watch(service, deadline) as watch:
                if any(response.status == health_pb2.HealthCheckResponse.SERVING for response in watch):
                    return

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> DiffusionClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
