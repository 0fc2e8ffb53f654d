"""The OpenAI Videos API: ``POST /v1/videos``, ``GET /v1/videos``, ``GET /v1/videos/{id}``,
``GET /v1/videos/{id}/content`` and ``DELETE /v1/videos/{id}``, in the shape OpenAI and vLLM-Omni
serve them, on the Images API's port and with its tokens, errors and body bounds.

A create answers at once with a job (``video_jobs``), status ``queued``; the job's request then
takes the path of a gRPC Generate through ``generate`` (the servicer's: validation, admission by
compute, the runner, MP4 encoding), whose progress events move the job's ``progress``. Every field
is checked before the job exists, with the worker's own ``normalize`` against the loaded model, so
a bad one is a 400 naming it and nothing runs; then the queue's own admission (``admit``), so that
a create the worker could not run now (draining: 503 unavailable; asleep without ``--auto-wake``:
503 failed_precondition; the queue full: 429) is refused as an Images API generation would be. A
create that is refused leaves no job behind.

The body is JSON, or multipart/form-data (what the OpenAI SDK's ``videos.create`` always sends)
with the input image as the file part ``input_reference`` (image-to-video). In JSON the image is
``input_reference: {"image_url": "data:image/png;base64,..."}``; URLs and file ids are refused:
this worker fetches nothing. Fields: ``prompt``, ``model``, ``size`` (``WxH``), ``seconds``, and
vLLM-Omni's extensions ``num_frames``, ``fps``, ``seed``, ``num_inference_steps``,
``negative_prompt`` and ``guidance_scale``. ``seconds`` becomes frames when ``num_frames`` is not
given (``frames_for``): round(seconds x fps) snapped to the nearest frame count on the model's grid
(Wan: 4k+1). The job reports ``seconds`` as the video's length, num_frames / fps. Numbers written as
text (``seconds``, multipart fields, ``limit``) are ASCII decimal (``params.decimal_number``). The
task is the request's: text-to-video, or image-to-video with ``input_reference``, so a model that
does not serve it is refused naming ``input_reference``.

Routes are metered in ``diffusion_requests_total`` as ``http:`` and the method and path template
(``http:POST /v1/videos``); creates, deletes and downloads count as activity for the idle timer,
polls do not (as GetStatus).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import logging
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import grpc
from starlette.datastructures import UploadFile
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from diffusion.v1 import common_pb2, worker_pb2
from serving_common.auth import TokenPolicy
from serving_common.errors import ServiceError, invalid_argument
from worker_service.config import Limits
from worker_service.http.body import BodyBudget, read_json
from worker_service.http.edits import INTEGERS, form_field, reading_form
from worker_service.http.errors import HttpRefusal, from_service_error
from worker_service.http.openai_images import check_model
from worker_service.http.params import decimal_int, decimal_number, openai_param, parse_generation
from worker_service.http.route_calls import Endpoint, RouteCall, RouteCalls
from worker_service.http.values import json_number, shown
from worker_service.image_inputs import input_sizes
from worker_service.lifecycle import Lifecycle
from worker_service.metrics import WorkerMetrics
from worker_service.served_names import ServedNames
from worker_service.validation import ValidationError, normalize
from worker_service.video_jobs import COMPLETED, JobError, VideoJob, VideoJobStore

logger = logging.getLogger(__name__)

VIDEOS = "/v1/videos"
VIDEO = "/v1/videos/{video_id}"
CONTENT = "/v1/videos/{video_id}/content"
INPUT_REFERENCE = "input_reference"
# vLLM-Omni's integer extensions, and the ranges their GenerateRequest fields take.
VIDEO_INTEGERS = {"num_frames": 2**32 - 1, "fps": 2**32 - 1}
VIDEO_FIELDS = frozenset({"seconds", INPUT_REFERENCE, *VIDEO_INTEGERS})
# The Images API's fields that say nothing of a video: refused as unknown rather than ignored.
IMAGE_ONLY = frozenset({"n", "response_format", "output_format", "quality", "style"})
# GenerateRequest field -> the Videos API field a caller set it with.
VIDEO_NAMES = {"image": INPUT_REFERENCE, "task": INPUT_REFERENCE}
# A job's poll interval (openai-poll-after-ms), which the SDK's poll helpers honour.
POLL_AFTER_MS = 500
LIST_LIMIT, MAX_LIST_LIMIT = 20, 100

OnProgress = Callable[[worker_pb2.ProgressEvent], None]
Generate = Callable[[worker_pb2.GenerateRequest, float | None, OnProgress | None],
                    Awaitable[worker_pb2.GenerateResponse]]


@dataclass(frozen=True)
class VideosApi:
    """What the routes need from the worker."""

    generate: Generate  # WorkerServicer.generate, with its progress callback
    lifecycle: Lifecycle  # the loaded model and its video capabilities
    metrics: WorkerMetrics
    policy: TokenPolicy | None
    on_activity: Callable[[str, bool], None]  # the idle timer's on_call
    bodies: BodyBudget
    jobs: VideoJobStore
    limits: Limits  # the worker's request limits, which normalize checks
    admit: Callable[[], None]  # raises what the queue would answer a request now (draining, asleep, full)
    served: ServedNames  # the names the model is asked for under


@dataclass(frozen=True)
class VideoAsk:
    """A create's body: the request (frames and fps not resolved yet), ``model`` if given, and
    ``seconds`` if given."""

    request: worker_pb2.GenerateRequest
    model: str | None
    seconds: float | None


def routes(api: VideosApi) -> list[Route]:
    videos = OpenAIVideos(api)
    return [Route(VIDEOS, videos.create, methods=["POST"]), Route(VIDEOS, videos.list, methods=["GET"]),
            Route(CONTENT, videos.content, methods=["GET"]), Route(VIDEO, videos.retrieve, methods=["GET"]),
            Route(VIDEO, videos.delete, methods=["DELETE"])]


def frames_for(seconds: float, fps: int, video: common_pb2.VideoCapabilities) -> int | None:
    """The frames of ``seconds`` at ``fps``: round(seconds x fps) snapped to the nearest count on
    the model's grid (frame_step x k + 1); None when seconds x fps is more than the model's
    max_frames (it may be more than a request can carry, or infinite). Whether the count is within
    the model's range is normalize's to say."""
    step = video.frame_step or 1
    wanted = seconds * fps
    if not wanted <= video.max_frames:
        return None
    wanted_frames = max(1, round(wanted))
    return step * round((wanted_frames - 1) / step) + 1


class OpenAIVideos:
    def __init__(self, api: VideosApi) -> None:
        self._api = api
        self._calls = RouteCalls(api.metrics, api.policy, api.on_activity)

    async def create(self, request: Request) -> Response:
        async def created(call: RouteCall) -> Response:
            ask = await read_video(request, self._api.bodies)
            check_model(self._api.lifecycle, self._api.served, ask.model, videos=True)
            job, generate = await self._job(ask)
            self._api.admit()  # a job that could not run now is refused, not made to fail at once
            self._api.jobs.add(job)  # refused when full: nothing runs
            job.task = asyncio.create_task(self._run(job, generate), name=f"video {job.id}")
            return JSONResponse(job.as_json())

        return await self._calls.call(request, ENDPOINTS["POST", VIDEOS], created)

    async def retrieve(self, request: Request) -> Response:
        async def retrieved(call: RouteCall) -> Response:
            job = self._api.jobs.get(request.path_params["video_id"])
            headers = {} if job.finished else {"openai-poll-after-ms": str(POLL_AFTER_MS)}
            return JSONResponse(job.as_json(), headers=headers)

        return await self._calls.call(request, ENDPOINTS["GET", VIDEO], retrieved)

    async def list(self, request: Request) -> Response:
        async def listed(call: RouteCall) -> Response:
            return JSONResponse(_page(self._api.jobs.jobs(), request))

        return await self._calls.call(request, ENDPOINTS["GET", VIDEOS], listed)

    async def content(self, request: Request) -> Response:
        async def downloaded(call: RouteCall) -> Response:
            variant = request.query_params.get("variant", "video")
            if variant != "video":
                raise invalid_argument({"variant": f"only video is served here (no thumbnail or spritesheet), "
                                                   f"got {variant[:40]!r}"})
            job = self._api.jobs.get(request.path_params["video_id"])
            if job.status != COMPLETED:
                raise NotReady(job)
            return Response(job.content, media_type="video/mp4")

        return await self._calls.call(request, ENDPOINTS["GET", CONTENT], downloaded)

    async def delete(self, request: Request) -> Response:
        async def deleted(call: RouteCall) -> Response:
            job = await self._api.jobs.delete(request.path_params["video_id"])
            return JSONResponse({"id": job.id, "object": "video.deleted", "deleted": True})

        return await self._calls.call(request, ENDPOINTS["DELETE", VIDEO], deleted)

    async def _job(self, ask: VideoAsk) -> tuple[VideoJob, worker_pb2.GenerateRequest]:
        """The job ``ask`` stands for and its request, every field checked as the worker will."""
        model = self._api.lifecycle.model
        if model is None:
            raise ServiceError(grpc.StatusCode.FAILED_PRECONDITION, "no model is loaded (GET /v1/models)")
        video, request = model.capabilities.video, ask.request
        request.task = common_pb2.TASK_IMAGE_TO_VIDEO if request.image else common_pb2.TASK_TEXT_TO_VIDEO
        if request.task not in model.capabilities.tasks:
            why = (f"makes videos from text only: it takes no {INPUT_REFERENCE}" if request.image else
                   f"makes videos from an image only: it needs an {INPUT_REFERENCE} (the first frame)")
            raise invalid_argument({INPUT_REFERENCE: f"{model.source!r} {why}"})
        fps = request.fps or video.default_fps
        too_long: list[tuple[str, str]] = []
        from_seconds = not request.num_frames and ask.seconds is not None
        if from_seconds:
            assert ask.seconds is not None
            frames = frames_for(ask.seconds, fps, video)
            if frames is None:
                too_long.append(("seconds", f"{ask.seconds:g} s at {fps} fps is more than the {video.max_frames} "
                                            f"frames {model.source!r} makes"))
            else:
                request.num_frames = frames
        request.request_id = uuid.uuid4().hex
        try:
            sizes = await input_sizes(request, self._api.limits.max_size)
            checked = normalize(request, self._api.limits, (), model=model,
                                image_size=sizes.image if sizes else None)
        except ValidationError as error:
            if from_seconds:  # the frames came from seconds: name what the caller set
                said = f"{ask.seconds:g} s at {fps} fps is {request.num_frames} frames; num_frames "
                raise invalid_argument([("seconds", said + description) if field == "num_frames" else
                                        (field, description) for field, description in error.violations]
                                       + too_long) from None
            raise invalid_argument(error.violations) from None
        if too_long:
            raise invalid_argument(too_long)
        # What the job reports is what runs: the defaults normalize chose, made explicit.
        request.width, request.height, request.num_frames, request.fps = (checked.width, checked.height,
                                                                          checked.num_frames, checked.fps)
        job = VideoJob(id=f"video_{request.request_id}", model=model.source, prompt=request.prompt,
                       size=f"{checked.width}x{checked.height}", seconds=_length(request.num_frames, request.fps),
                       num_frames=request.num_frames, fps=request.fps, created_at=int(self._api.jobs.now()))
        return job, request

    async def _run(self, job: VideoJob, request: worker_pb2.GenerateRequest) -> None:
        """Runs ``job``'s request and keeps its outcome; a delete cancels it here."""
        jobs = self._api.jobs
        try:
            response = await self._api.generate(request, None, job.on_progress)
        except ServiceError as error:
            said = from_service_error(error, video_param)
            jobs.fail(job, JobError(said.code or "unknown", said.message, said.param))
            return
        except asyncio.CancelledError:
            raise
        except Exception:  # noqa: BLE001 - a bug: the job says internal, the details go to the log
            logger.exception("video job %s failed unexpectedly", job.id)
            jobs.fail(job, JobError("internal", f"internal error in job {job.id}; the details are in the server log"))
            return
        self._api.metrics.record_generation(request, response)
        if len(response.videos) != 1:
            jobs.fail(job, JobError("internal", f"the worker returned {len(response.videos)} videos, not 1"))
            return
        jobs.complete(job, response.videos[0].data)


class NotReady(HttpRefusal):
    """A download of a job that has no video (yet): 409, as OpenAI answers it."""

    def __init__(self, job: VideoJob) -> None:
        why = f": {job.error.message}" if job.error is not None else ""
        super().__init__(grpc.StatusCode.FAILED_PRECONDITION, f"video {job.id} is {job.status}, not completed{why}",
                         (409, "invalid_request_error"), param="video_id")


def _length(num_frames: int, fps: int) -> str:
    """The video's length in seconds, as the job's ``seconds`` reports it."""
    return f"{num_frames / fps:g}" if fps else "0"


def video_param(field: str) -> tuple[str, str]:
    """The Videos API name of a GenerateRequest field (``openai_param``'s, but the image is
    ``input_reference``), and the words that say which part of it is meant."""
    name = VIDEO_NAMES.get(field)
    return (name, "") if name is not None else openai_param(field)


def _endpoint(verb: str, route: str, active: bool) -> Endpoint:
    """Creates, downloads and deletes follow gRPC Generate's token rule and count as activity;
    polls follow GetStatus's, quiet like it."""
    return Endpoint(f"http:{verb} {route}", f"{verb} {route}", "Generate" if active else "GetStatus",
                    activity=active, param_of=video_param)


ENDPOINTS = {(verb, route): _endpoint(verb, route, active) for verb, route, active in (
    ("POST", VIDEOS, True), ("GET", VIDEOS, False), ("GET", VIDEO, False), ("GET", CONTENT, True),
    ("DELETE", VIDEO, True))}


async def read_video(request: Request, budget: BodyBudget) -> VideoAsk:
    """A create's body, JSON or multipart (the SDK's); INVALID_ARGUMENT naming each bad field."""
    content_type = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if content_type == "multipart/form-data":
        fields, image = await _read_form(request, budget)
    else:
        body = await read_json(request, budget)
        if not isinstance(body, dict):
            raise invalid_argument((), "the request body must be a JSON object")
        fields = body
        image = _image_url(body.get(INPUT_REFERENCE))
    return _parsed(fields, image)


async def _read_form(request: Request, budget: BodyBudget) -> tuple[dict[str, object], bytes]:
    """The text fields (typed as JSON would type them) and the ``input_reference`` file of a
    multipart body, bounded as an edit's (``reading_form``), with one file."""
    async with reading_form(request, budget, max_files=1) as form:
        fields: dict[str, object] = {}
        image = b""
        violations: list[tuple[str, str]] = []
        for name, value in form.multi_items():
            if name in fields:
                violations.append((name, "is given more than once"))
            elif isinstance(value, UploadFile):
                if name == INPUT_REFERENCE:
                    image = await value.read()
                    fields[name] = None
                    if not image:
                        violations.append((name, "is an empty file"))
                else:
                    violations.append((name, "must be a text field, not a file part"))
                await value.close()
            elif name == INPUT_REFERENCE:
                violations.append((name, "must be a file part (PNG, JPEG or WebP)"))
            else:
                fields[name] = form_field(name, value, INTEGERS | VIDEO_INTEGERS.keys())
        del form
    if violations:
        raise invalid_argument(violations)
    return fields, image


def _image_url(reference: object) -> bytes:
    """The image of a JSON body's ``input_reference``: a base64 data URL only."""
    if reference is None:
        return b""
    url = reference.get("image_url") if isinstance(reference, dict) else None
    if not isinstance(url, str) or not url.startswith("data:") or ";base64," not in url:
        raise invalid_argument({INPUT_REFERENCE: "must be {\"image_url\": \"data:image/png;base64,...\"} in JSON, or "
                                                 "a file part of multipart/form-data: this worker fetches no URLs "
                                                 "or file ids"})
    try:
        return base64.b64decode(url.split(";base64,", 1)[1], validate=True)
    except (binascii.Error, ValueError):
        raise invalid_argument({INPUT_REFERENCE: "image_url is not valid base64"}) from None


def _parsed(fields: dict[str, object], image: bytes) -> VideoAsk:
    """The request the fields say: the Images API's fields through ``parse_generation``, the
    video ones here; INVALID_ARGUMENT naming every bad field."""
    violations: list[tuple[str, str]] = []
    given = {name: value for name, value in fields.items() if value is not None}
    numbers: dict[str, int] = {}
    for name, highest in VIDEO_INTEGERS.items():
        if name in given:
            value = given[name]
            if isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= highest:
                numbers[name] = value
            else:
                violations.append((name, f"must be an integer from 1 to {highest}, got {shown(value)}"))
    seconds = _seconds(given.get("seconds"), violations)
    generation = {name: value for name, value in fields.items() if name not in VIDEO_FIELDS}
    for name in IMAGE_ONLY & set(generation):
        violations.append((name, "unknown or unsupported parameter (an Images API field)"))
        del generation[name]
    try:
        parsed = parse_generation(generation)
    except ServiceError as error:
        violations.extend(error.violations)
        parsed = None
    if violations or parsed is None:
        raise invalid_argument(violations)
    request = parsed.request
    request.output_format = worker_pb2.OUTPUT_FORMAT_MP4
    request.image = image
    request.num_frames = numbers.get("num_frames", 0)
    request.fps = numbers.get("fps", 0)
    return VideoAsk(request, parsed.model, seconds)


def _seconds(value: object, violations: list[tuple[str, str]]) -> float | None:
    """``seconds``: OpenAI sends a string ("4"), JSON callers may send a number; positive, finite."""
    if value is None:
        return None
    seconds = decimal_number(value) if isinstance(value, str) else json_number(value)
    if seconds is None or seconds <= 0:
        violations.append(("seconds", f"must be a number of seconds above 0 in decimal digits, got {shown(value)}"))
        return None
    return seconds


def _page(jobs: list[VideoJob], request: Request) -> dict[str, object]:
    """OpenAI's cursor page of jobs: ``order`` (desc, the default: newest first), ``after`` (an
    id: the jobs after it in that order), ``limit`` (1 to 100, default 20)."""
    query = request.query_params
    order, asked = query.get("order", "desc"), query.get("limit", str(LIST_LIMIT))
    if order not in ("asc", "desc"):
        raise invalid_argument({"order": f"must be asc or desc, got {order[:40]!r}"})
    limit = decimal_int(asked)
    if limit is None or not 1 <= limit <= MAX_LIST_LIMIT:
        raise invalid_argument({"limit": f"must be an integer from 1 to {MAX_LIST_LIMIT}, got {asked[:40]!r}"})
    ordered = jobs if order == "asc" else jobs[::-1]
    after = query.get("after")
    if after is not None:
        ids = [job.id for job in ordered]
        if after not in ids:
            raise invalid_argument({"after": f"no video job {after[:80]!r}"})
        ordered = ordered[ids.index(after) + 1:]
    page = ordered[:limit]
    return {"object": "list", "data": [job.as_json() for job in page], "has_more": len(ordered) > len(page),
            "first_id": page[0].id if page else None, "last_id": page[-1].id if page else None}
