"""The OpenAI Images API: ``POST /v1/images/generations``, ``POST /v1/images/edits`` and
``GET /v1/models``, a Starlette app; beside it ``GET /health`` and ``GET /metrics``, as vLLM and
SGLang serve them on their API port.

A generation or an edit takes the path of a gRPC Generate: the body becomes a GenerateRequest
(``params``, ``edits``), which ``generate`` (the servicer's) validates with ``normalize``, admits
to the same AdmissionQueue (bounded, batched, with the same deadlines) and encodes; with
``response_format: "url"`` the images are then kept (``keep_urls``: ``image_urls``) and the answer
gives their URLs instead of their bytes. Around every route but ``/health`` and ``/metrics``,
``route_calls`` does what the gRPC interceptors do for gRPC: tokens (generations and edits as
Generate, models as GetStatus), metrics and errors. ``/health`` and ``/metrics`` are open, as gRPC
health and the metrics port are. Beside that:

- ``model``, when a body gives it, must name the loaded model: one of its ``--served-model-name``
  names, as ``GET /v1/models`` lists them, or without that flag its source or the last component
  of that path (``model_aliases``); another name is 404, naming the served ones.
- Metrics: calls count in ``diffusion_requests_total`` as method ``http:`` and the path;
  generations and edits count as activity for the idle timer and their images are recorded as
  gRPC ones are. ``/metrics`` is the metrics port's text, from the same registry.
- Deadlines: an ``X-Request-Timeout`` header (seconds) is the call's deadline, as a gRPC deadline
  is; without it there is none (the request waits in the queue like a gRPC call without one).
- Cancellation: a client that disconnects cancels its request, queued or running, as a cancelled
  gRPC call does (the ASGI receive channel reports the disconnect while the request waits).
- Streaming: with ``stream: true`` the images (and ``partial_images`` previews) come as server-sent
  events (``image_stream``); the call is counted when its stream ends.

Errors are OpenAI's JSON shape (``errors``); unknown paths are 404 and wrong methods 405, alike.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Any, TypeVar

import grpc
from google.protobuf.message import Message
from prometheus_client.exposition import choose_encoder
from starlette.applications import Starlette
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Receive

from diffusion.v1 import worker_pb2
from serving_common.auth import TokenPolicy
from serving_common.errors import ServiceError, invalid_argument
from serving_common.hub_ids import HubId
from serving_common.input_rules import VIDEO_TASKS
from serving_common.logs import REQUEST_ID_METADATA
from worker_service.http.body import BodyBudget, read_json
from worker_service.http.edits import read_edit
from worker_service.http.errors import OpenAIError
from worker_service.http.image_stream import Generate, ImageStream, StreamShape, server_sent_events
from worker_service.http.params import ImagesRequest, decimal_number, parse_generation
from worker_service.http.route_calls import Endpoint, RouteCall, RouteCalls
from worker_service.lifecycle import Lifecycle
from worker_service.metrics import WorkerMetrics
from worker_service.served_names import ServedNames

logger = logging.getLogger(__name__)

GENERATIONS = "/v1/images/generations"
EDITS = "/v1/images/edits"
MODELS = "/v1/models"
HEALTH = "/health"
METRICS = "/metrics"
# Generations and edits follow gRPC Generate's token rule, count as activity and as generations;
# models follows GetStatus's, quiet for the idle timer like it.
ENDPOINTS = {GENERATIONS: Endpoint(f"http:{GENERATIONS}", f"POST {GENERATIONS}", "Generate", activity=True,
                                   generation=True),
             EDITS: Endpoint(f"http:{EDITS}", f"POST {EDITS}", "Generate", activity=True, generation=True),
             MODELS: Endpoint(f"http:{MODELS}", f"GET {MODELS}", "GetStatus")}
TIMEOUT_HEADER = "x-request-timeout"
OWNED_BY = "diffusion-serving"

T = TypeVar("T")
Parse = Callable[[Request], Awaitable[ImagesRequest]]
# Keeps a response's images for response_format url; their URLs, as the request's client reaches them.
KeepUrls = Callable[[Request, Sequence[worker_pb2.Image]], list[str]]


@dataclass(frozen=True)
class ImagesApi:
    """What the routes need from the worker."""

    generate: Generate  # WorkerServicer.generate: validation, admission, encoding (and progress, streamed)
    lifecycle: Lifecycle  # the loaded model
    metrics: WorkerMetrics
    policy: TokenPolicy | None  # the same object the gRPC BearerTokenInterceptor asks
    on_activity: Callable[[str, bool], None]  # the idle timer's on_call
    started: int  # unix time the worker started: the ``created`` of its model
    bodies: BodyBudget  # request bodies being read, over all connections
    keep_urls: KeepUrls  # image_urls.ImageUrls.keep: response_format url
    served: ServedNames  # the names the model is listed and asked for under


def create_app(api: ImagesApi, more: Sequence[Route] = ()) -> Starlette:
    """The Images API's routes and ``more`` (the Videos API's, ``openai_videos.routes``)."""
    routes = OpenAIImages(api)
    app = Starlette(
        routes=[Route(GENERATIONS, routes.generations, methods=["POST"]),
                Route(EDITS, routes.edits, methods=["POST"]),
                Route(MODELS, routes.models, methods=["GET"]),
                Route(HEALTH, routes.health, methods=["GET"]),
                Route(METRICS, routes.metrics, methods=["GET"]), *more],
        exception_handlers={HTTPException: http_exception},
    )
    # A path with a trailing slash is unknown (404), not redirected: Starlette's 307 points at the
    # Host header the client sent, and OpenAI's SDKs never add the slash.
    app.router.redirect_slashes = False
    return app


async def http_exception(request: Request, error: Exception) -> Response:
    """Starlette's own refusals (404 unknown path, 405 wrong method) in OpenAI's shape."""
    assert isinstance(error, HTTPException)
    kinds = {404: ("not_found_error", "unknown_url", f"no such endpoint: {request.method} {request.url.path}"),
             405: ("invalid_request_error", "method_not_allowed",
                   f"{request.method} is not allowed on {request.url.path}")}
    type_, code, message = kinds.get(error.status_code, ("invalid_request_error", None, str(error.detail)))
    return OpenAIError(error.status_code, type_, message, code=code, headers=error.headers).response()


class OpenAIImages:
    def __init__(self, api: ImagesApi) -> None:
        self._api = api
        self._calls = RouteCalls(api.metrics, api.policy, api.on_activity)

    async def generations(self, request: Request) -> Response:
        return await self._calls.call(request, ENDPOINTS[GENERATIONS],
                                      lambda call: self._images(request, call, GENERATIONS, self._generation))

    async def edits(self, request: Request) -> Response:
        return await self._calls.call(request, ENDPOINTS[EDITS], lambda call: self._images(
            request, call, EDITS, lambda request: read_edit(
                request, self._api.bodies, self._api.metrics.limits.max_size)))  # the worker's Limits

    async def _generation(self, request: Request) -> ImagesRequest:
        return parse_generation(await read_json(request, self._api.bodies))

    async def _images(self, request: Request, call: RouteCall, route: str, parse: Parse) -> Response:
        """A generation or an edit: ``parse`` reads the body into the request it stands for."""
        api, request_id = self._api, call.request_id
        timeout = _timeout(request.headers)
        parsed = await parse(request)
        check_model(api.lifecycle, api.served, parsed.model)
        parsed.request.request_id = request_id
        if parsed.stream:
            return await self._stream(request, call, route, parsed, timeout)
        response = await _until_disconnect(request.receive, api.generate(parsed.request, timeout, None), timeout)
        if response is None:
            raise ClientDisconnect()
        api.metrics.record_generation(parsed.request, response)
        urls = api.keep_urls(request, response.images) if parsed.response_format == "url" else None
        content = await asyncio.to_thread(_images_json, response, urls)  # base64 of big images: off the loop
        return Response(content, media_type="application/json", headers={REQUEST_ID_METADATA: request_id})

    async def _stream(self, request: Request, call: RouteCall, route: str, parsed: ImagesRequest,
                      timeout: float | None) -> StreamingResponse:
        """A streamed generation or edit (``image_stream``), once its request runs; raises what an
        unstreamed one would before that (a refusal, the deadline, ClientDisconnect). The stream
        ends the call when it ends."""
        api, request_id = self._api, call.request_id
        stream = ImageStream(api.generate, parsed.request, timeout)
        if not await _until_disconnect(request.receive, stream.begun(), timeout):
            raise ClientDisconnect()
        end_call = call.hand_over()

        def ended(code: grpc.StatusCode, response: worker_pb2.GenerateResponse | None) -> None:
            if response is not None:
                api.metrics.record_generation(parsed.request, response)
            end_call(code)

        shape = StreamShape.of("image_edit" if route == EDITS else "image_generation", parsed.request)
        return StreamingResponse(server_sent_events(stream, shape, request_id, ended), media_type="text/event-stream",
                                 headers={REQUEST_ID_METADATA: request_id, "cache-control": "no-cache"})

    async def models(self, request: Request) -> Response:
        """The loaded model under each of its served names, as OpenAI lists models (an empty list
        without one). Quiet for the idle timer, like GetStatus."""
        async def listed(call: RouteCall) -> Response:
            data = [{"id": name, "object": "model", "created": self._api.started, "owned_by": OWNED_BY}
                    for name in self._api.served.of(self._api.lifecycle.model)]
            return JSONResponse({"object": "list", "data": data})

        return await self._calls.call(request, ENDPOINTS[MODELS], listed)

    async def health(self, request: Request) -> Response:
        """Liveness, as vLLM's ``/health``: 200 while the process serves, ready or not (readiness is
        gRPC health's, and ``GetStatus``'s). Open, and not counted, like gRPC health."""
        return Response(status_code=200)

    async def metrics(self, request: Request) -> Response:
        """The metrics port's Prometheus text: the same registry, the same format for the same
        ``Accept`` (OpenMetrics when asked for). Open, as that port is."""
        encoder, content_type = choose_encoder(request.headers.get("accept", ""))
        return Response(encoder(self._api.metrics.registry), headers={"content-type": content_type})


def check_model(lifecycle: Lifecycle, served: ServedNames, asked: str | None, videos: bool = False) -> None:
    """``model``, when given, must name the loaded model: one of its ``served`` names, or without
    those ``model_aliases`` (NOT_FOUND otherwise, 404): one worker serves one model. That model
    must make what the API serves: videos for the Videos API (``videos``), images for the Images
    API (a model whose tasks are all video tasks is refused here, not left to ``normalize``, which
    would blame the image output_format the caller never set). Without a model loaded the request
    goes on, to be refused as not ready (503)."""
    loaded = lifecycle.model
    if loaded is None:
        return
    names = served.of(loaded)
    if asked is not None and asked not in (names if served.renames(loaded) else model_aliases(loaded.source)):
        served_as = ", ".join(repr(name) for name in names)
        raise ServiceError(grpc.StatusCode.NOT_FOUND, f"model {asked!r} is not served here; this worker serves "
                           f"{served_as} (GET {MODELS})", [("model", "is not a served model name")])
    tasks = set(loaded.capabilities.tasks)
    if videos and not loaded.capabilities.HasField("video"):
        raise invalid_argument({"model": f"{loaded.source!r} makes images, not videos (POST {GENERATIONS})"})
    if not videos and tasks and tasks <= VIDEO_TASKS:
        raise invalid_argument({"model": f"{loaded.source!r} makes videos, not images (POST /v1/videos)"})


def model_aliases(source: str) -> frozenset[str]:
    """The names a request's ``model`` may give the loaded model: its source (a built-in name or
    the directory Init was given, as ``GET /v1/models`` lists it) and, for a directory, its last
    component, as vLLM users name a model by its directory (``/models/sd-turbo/``: ``sd-turbo``);
    for a Hugging Face id at a revision (``org/name@v2``, or the commit a restarted runner was
    pinned to), the id alone (``org/name``)."""
    hub_id = HubId.parse(source)
    return frozenset({source, PurePosixPath(source).name, hub_id.repo_id if hub_id else ""} - {""})


def _timeout(headers: Headers) -> float | None:
    raw = headers.get(TIMEOUT_HEADER)
    if raw is None:
        return None
    seconds = decimal_number(raw)
    if seconds is None or seconds <= 0:
        raise invalid_argument({"X-Request-Timeout": f"must be seconds > 0, got {raw!r}"})
    return seconds


async def _until_disconnect(receive: Receive, work: Awaitable[T], timeout: float | None) -> T | None:
    """``work``'s result; None when the client disconnects first. Either way, and when the deadline
    passes (DEADLINE_EXCEEDED), ``work`` is cancelled first, which ends its request: the servicer
    releases the job from the queue, or stops its batch when no other request needs it."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.create_task(_disconnected(receive))
    try:
        await asyncio.wait({task, watcher}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:  # also when this handler is cancelled itself (the server shutting down)
        watcher.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    if not task.cancelled():
        return task.result()
    if watcher.cancelled() or not watcher.done():
        raise ServiceError(grpc.StatusCode.DEADLINE_EXCEEDED, f"the deadline (X-Request-Timeout: {timeout:g} s) "
                                                              "passed before the images were ready")
    return None


async def _disconnected(receive: Receive) -> None:
    """Returns when the client has gone. Once the body is read, the server's receive channel has
    nothing to deliver but ``http.disconnect``."""
    while (await receive())["type"] != "http.disconnect":
        pass


def _images_json(response: worker_pb2.GenerateResponse, urls: list[str] | None) -> bytes:
    """OpenAI's ImagesResponse: each image's ``url`` when ``urls`` are given, else its ``b64_json``;
    each also says its ``seed``, and the body its ``timings`` (extensions, as in gRPC)."""
    key, values = ("url", urls) if urls is not None else (
        "b64_json", [base64.b64encode(image.data).decode("ascii") for image in response.images])
    data = [{key: value, "seed": image.seed} for value, image in zip(values, response.images, strict=True)]
    return json.dumps({"created": int(time.time()), "data": data, "timings": _fields(response.timings)}).encode()


def _fields(message: Message) -> dict[str, Any]:
    """Every field of ``message`` by its proto name, zeros included, nested messages as objects."""
    return {field.name: _fields(value) if isinstance(value := getattr(message, field.name), Message) else value
            for field in message.DESCRIPTOR.fields}
