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

import time
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

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
class DiffusionClient(ClientBase):
    """A blocking client of one worker; use it as a context manager or call ``close()``."""

    grpc_module = grpc

    def generate(self, prompt: str, *, timeout: float | None = None, **options: Any) -> GenerateResult:
        """Generates images and returns them when all are done (None: the worker's default).

        ``options`` are those of ``clients.types.build_generate_request`` (None: the worker's default).
        """
        request = types.build_generate_request(prompt, **options)
        response = self._stub.Generate(request, **self._options(timeout))
        return GenerateResult.from_proto(response)

    def stream(self, prompt: str, *, timeout: float | None = None, **options: Any) -> EventStream:
        """Like ``generate``, but yields Queued, Started and Progress events before Done.

        ``options`` are those of ``clients.types.build_generate_request`` (None: the worker's default).
        """
        return self._stream(types.build_generate_request(prompt, **options), timeout)

    def _stream(self, request: worker_pb2.GenerateRequest, timeout: float | None) -> EventStream:
        call = self._stub.GenerateStream(
            worker_pb2.GenerateStreamRequest(request=request), **self._options(timeout))
        return EventStream(call)

    def stream_video(self, prompt: str, *, timeout: float | None = None, **options: Any) -> EventStream:
        """Like ``generate_video``, but yields its events: Queued, Started, Progress (of each phase),
        the video's Chunks, then Done, whose ``result.video()`` is the video.

        ``options`` are those of ``clients.types.build_video_request``.
        """
        return self._stream(types.build_video_request(prompt, **options), timeout)

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

    def cancel(self, request_id: str, *, timeout: float | None = None) -> str:
        """Cancels a queued or running request; returns where it was ("queued" or "running")."""
        response: worker_pb2.CancelResponse = self._stub.Cancel(
            worker_pb2.CancelRequest(request_id=request_id), **self._options(timeout))
        return response.was

    def status(self, *, timeout: float | None = None) -> worker_pb2.GetStatusResponse:
        response: worker_pb2.GetStatusResponse = self._stub.GetStatus(
            worker_pb2.GetStatusRequest(), **self._options(timeout))
        return response

    def init(self, model: str, dtype: str | int | None = None, *,
             acceleration: common_pb2.Acceleration | Mapping[str, Any] | None = None,
             parallel: common_pb2.Parallelism | Mapping[str, Any] | None = None,
             timeout: float | None = None) -> worker_pb2.InitResponse:
        """Loads ``model`` (a built-in name or a directory on the runner's filesystem), accelerated as
        ``acceleration`` says and spread over each runner's devices as ``parallel`` says
        (``types.build_init_request``)."""
        response: worker_pb2.InitResponse = self._stub.Init(
            types.build_init_request(model, dtype, acceleration, parallel), **self._options(timeout))
        return response

    def sleep(self, level: int = 1, tags: Iterable[str] = (), *,
              timeout: float | None = None) -> worker_pb2.SleepResponse:
        response: worker_pb2.SleepResponse = self._stub.Sleep(
            types.build_sleep_request(level, tags), **self._options(timeout))
        return response

    def wake(self, tags: Iterable[str] = (), *, timeout: float | None = None) -> worker_pb2.WakeUpResponse:
        response: worker_pb2.WakeUpResponse = self._stub.WakeUp(
            types.build_wake_request(tags), **self._options(timeout))
        return response

    def load_weights(self, path: str, *, timeout: float | None = None) -> worker_pb2.LoadWeightsResponse:
        """Loads safetensors weights from ``path`` on the runner's filesystem."""
        response: worker_pb2.LoadWeightsResponse = self._stub.LoadWeights(
            worker_pb2.LoadWeightsRequest(path=path), **self._options(timeout))
        return response

    def push_weights(self, weights: Weights, *, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                     on_progress: ProgressCallback | None = None,
                     timeout: float | None = None) -> PushResult:
        """Streams ``weights`` to the worker, which applies them on every runner, all or nothing.

        ``weights``: a state dict named "<component>.<parameter>" (``unet.conv_in.weight``), or the
        path of a .safetensors file on this machine, read one tensor at a time. Chunks carry at most
        ``chunk_bytes``; ``on_progress(bytes_sent, total_bytes)`` follows each, called from the
        thread that sends the stream. A state dict's tensors are read through their own torch; a
        file needs neither torch nor safetensors. Returns the new weights version, the checksum, the tensor
        names and the bytes received.
        """
        requests = push.push_requests(weights, chunk_bytes, on_progress)
        return PushResult.from_proto(self._stub.PushWeights(requests, **self._options(timeout)))

    def weights_checksum(self, *, timeout: float | None = None) -> worker_pb2.GetWeightsChecksumResponse:
        """The sha256 of the model's tensors as they are now, and the weights version."""
        response: worker_pb2.GetWeightsChecksumResponse = self._stub.GetWeightsChecksum(
            worker_pb2.GetWeightsChecksumRequest(), **self._options(timeout))
        return response

    def load_adapter(self, name: str, path: str | Path, *, pin: bool = False,
                     timeout: float | None = None) -> common_pb2.AdapterInfo:
        """Registers the LoRA file (or directory) at ``path`` on the runner's filesystem as ``name``.

        ``pin`` keeps it on the device: never evicted to make room for others.
        """
        request = worker_pb2.LoadAdapterRequest(name=name, path=str(path), pin=pin)
        response: worker_pb2.LoadAdapterResponse = self._stub.LoadAdapter(request, **self._options(timeout))
        return response.adapter

    def unload_adapter(self, name: str, *, timeout: float | None = None) -> None:
        self._stub.UnloadAdapter(worker_pb2.UnloadAdapterRequest(name=name), **self._options(timeout))

    def list_adapters(self, *, timeout: float | None = None) -> worker_pb2.ListAdaptersResponse:
        """The registered adapters (resident or not, requests per adapter) and --max-adapters."""
        response: worker_pb2.ListAdaptersResponse = self._stub.ListAdapters(
            worker_pb2.ListAdaptersRequest(), **self._options(timeout))
        return response

    def health(self, service: str = WORKER_SERVICE, *, timeout: float | None = None) -> str:
        """The health of ``service`` ("" for liveness): "SERVING", "NOT_SERVING", ..."""
        response = self._health.Check(health_pb2.HealthCheckRequest(service=service),
                                      **self._options(timeout))
        return types.health_name(response)

    def wait_ready(self, service: str = WORKER_SERVICE, *, timeout: float | None = None) -> None:
        """Returns once ``service`` is SERVING: waits for the worker to listen, then watches its
        health (a model loading, a runner starting). ``DeadlineExceeded`` when ``timeout`` passes first."""
        deadline = None if (limit := self._options(timeout)["timeout"]) is None else time.monotonic() + limit
        while True:
            remaining = None if deadline is None else max(deadline - time.monotonic(), 0.0)
            watch = self._health.Watch(health_pb2.HealthCheckRequest(service=service), wait_for_ready=True,
                                       timeout=remaining, metadata=self._metadata)
            try:
                if any(response.status == health_pb2.HealthCheckResponse.SERVING for response in watch):
                    return
            except grpc.RpcError as error:
                if error.code() != grpc.StatusCode.UNAVAILABLE:
                    raise
            finally:
                watch.cancel()
            # The worker went away (a restart): wait for it again.

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> DiffusionClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
