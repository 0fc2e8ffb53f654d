"""Streamed generations and edits (``stream: true``): the images as server-sent events, as OpenAI's
Images API sends them and its SDKs parse them (``images.generate(stream=True, partial_images=N)``,
``images.edit`` alike).

Each event is ``event: TYPE`` and ``data: JSON``; TYPE starts with ``image_generation`` (an edit:
``image_edit``):

- ``….partial_image``, for each preview of each image (``partial_images``, 0 to 3, at evenly spaced
  steps): ``b64_json`` (in the request's ``output_format``), ``partial_image_index`` (from 0),
  ``size`` (the preview's own: the latent resolution, an eighth of the image's side for most
  models), ``output_format``, ``created_at``, ``background`` (``opaque``) and ``quality``
  (``auto``); and ``image_index`` (an extension: which of the ``n`` images). A model whose family
  has no preview map sends none (docs/http.md).
- ``….completed``, once per image when all are done: the same fields but ``partial_image_index``,
  with the image itself, ``usage`` (zeros: nothing here counts tokens), and ``seed`` and
  ``image_index`` (extensions, as ``seed`` is in an unstreamed response).
- A failure once the stream has begun: one event whose data is OpenAI's error object
  (``{"error": {...}}``, ``errors``), which the SDK raises as ``APIError``; the stream ends there.

The response begins (200, ``text/event-stream``) once the request runs (its first progress event)
or has ended, so a request refused before that (a bad field, a full queue, no model) gets the JSON
error and status an unstreamed one gets. The ``X-Request-Timeout`` deadline holds for the whole
stream, and a client that disconnects cancels its request, as an unstreamed one does.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import grpc

from diffusion.v1 import worker_pb2
from serving_common.errors import ServiceError
from worker_service.http.errors import from_service_error, internal_error
from worker_service.http.params import OUTPUT_FORMATS, openai_param

logger = logging.getLogger(__name__)

OnProgress = Callable[[worker_pb2.ProgressEvent], None]
# WorkerServicer.generate: the request, its deadline's seconds (None: none), its progress callback.
Generate = Callable[[worker_pb2.GenerateRequest, float | None, OnProgress | None],
                    Awaitable[worker_pb2.GenerateResponse]]
# Called once when a stream ends: how it ended, and its response when it got one.
OnEnd = Callable[[grpc.StatusCode, worker_pb2.GenerateResponse | None], None]

FORMAT_NAMES = {value: name for name, value in OUTPUT_FORMATS.items()}
# What OpenAI reports of GPT image models' tokens; no tokens are counted here.
NO_USAGE = {"input_tokens": 0, "input_tokens_details": {"image_tokens": 0, "text_tokens": 0},
            "output_tokens": 0, "total_tokens": 0}


@dataclass(frozen=True)
class StreamShape:
    """What every event of one stream says: its kind (``image_generation`` or ``image_edit``) and
    the request's output format."""

    kind: str
    output_format: str

    @classmethod
    def of(cls, kind: str, request: worker_pb2.GenerateRequest) -> StreamShape:
        return cls(kind, FORMAT_NAMES.get(request.output_format, "png"))

    def event(self, suffix: str, image: worker_pb2.Image, image_index: int, **fields: Any) -> bytes:
        """One event of an image (a preview or a finished one)."""
        data = {"type": f"{self.kind}.{suffix}", "b64_json": base64.b64encode(image.data).decode("ascii"),
                "created_at": int(time.time()), "size": f"{image.width}x{image.height}",
                "output_format": self.output_format, "background": "opaque", "quality": "auto",
                "image_index": image_index, **fields}
        return server_sent(data["type"], data)


def server_sent(event: str, data: object) -> bytes:
    return f"event: {event}\ndata: {json.dumps(data)}\n\n".encode()


class ImageStream:
    """One streamed request: its generate call (started here), its previews as they come, its end."""

    def __init__(self, generate: Generate, request: worker_pb2.GenerateRequest, timeout: float | None) -> None:
        loop = asyncio.get_running_loop()
        self._previews: asyncio.Queue[worker_pb2.ProgressEvent] = asyncio.Queue()  # at most 3 per image
        self._running = asyncio.Event()
        self._timeout = timeout
        self._deadline = None if timeout is None else loop.time() + timeout
        self._work = asyncio.ensure_future(generate(request, timeout, self._progress))

    def _progress(self, event: worker_pb2.ProgressEvent) -> None:
        self._running.set()
        if event.previews:
            self._previews.put_nowait(event)

    async def begun(self) -> bool:
        """True once the request runs or has ended; raises its error when it ended before running
        (a refusal). Cancelled, it cancels the request."""
        running = asyncio.ensure_future(self._running.wait())
        try:
            await asyncio.wait({running, self._work}, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:
            self.close()
            raise
        finally:
            running.cancel()
        if not self._running.is_set() and self._work.done():
            self._work.result()
        return True

    async def events(self) -> AsyncIterator[worker_pb2.ProgressEvent | worker_pb2.GenerateResponse]:
        """Each progress event that brings previews, then the response; raises the request's
        ServiceError, or DEADLINE_EXCEEDED when its deadline passes first."""
        while True:
            left = None if self._deadline is None else max(self._deadline - asyncio.get_running_loop().time(), 0)
            preview = asyncio.ensure_future(self._previews.get())
            try:
                done, _ = await asyncio.wait({preview, self._work}, timeout=left,
                                             return_when=asyncio.FIRST_COMPLETED)
            finally:
                preview.cancel()  # one not taken stays in the queue
            if preview in done:
                yield preview.result()
            elif self._work.done():
                while not self._previews.empty():
                    yield self._previews.get_nowait()
                yield self._work.result()
                return
            else:
                raise ServiceError(grpc.StatusCode.DEADLINE_EXCEEDED,
                                   f"the deadline (X-Request-Timeout: {self._timeout:g} s) passed before the "
                                   "images were ready")

    def close(self) -> None:
        """Cancels the request if it has not ended."""
        self._work.cancel()


async def server_sent_events(stream: ImageStream, shape: StreamShape, request_id: str,
                             on_end: OnEnd) -> AsyncIterator[bytes]:
    """The stream's events (see the module); ``on_end`` is told how it ended, however it ends (a
    client gone cancels this generator, and with it the request: CANCELLED)."""
    code, response = grpc.StatusCode.CANCELLED, None
    try:
        async for event in stream.events():
            if isinstance(event, worker_pb2.ProgressEvent):
                for index, image in enumerate(event.previews):
                    yield shape.event("partial_image", image, index, partial_image_index=event.partial_image_index)
                continue
            response = event
            for index, image in enumerate(event.images):  # base64 of big images: off the loop
                yield await asyncio.to_thread(shape.event, "completed", image, index, usage=NO_USAGE,
                                              seed=image.seed)
        code = grpc.StatusCode.OK
    except ServiceError as error:
        code = error.code
        yield server_sent("error", from_service_error(error, openai_param, request_id).body())
    except Exception:  # noqa: BLE001 - a bug: a short error event here, the details in the log
        code = grpc.StatusCode.INTERNAL
        logger.exception("a streamed request failed unexpectedly (request id %s)", request_id)
        yield server_sent("error", internal_error(request_id).body())
    finally:
        stream.close()
        on_end(code, response)
