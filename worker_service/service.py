"""The WorkerService servicer: thin over the domain layer. It validates, admits, relays events
and encodes; lifecycle RPCs delegate to the controller and the runner pool. Every method is
wrapped in ``reports_errors``, the one place errors become statuses.

A video's bytes can exceed one gRPC message: GenerateStream sends them in ResultChunk events before
``done``, and Generate refuses a result above ``--max-message-bytes`` (before it runs when its raw
frames alone are), naming GenerateStream."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Callable, Collection, Iterator

import grpc

from diffusion.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from serving_common.conditioning_rules import KIND_NAMES
from serving_common.deadlines import carried, time_left
from serving_common.errors import ServiceError, failed_precondition, invalid_argument, reports_errors
from serving_common.input_rules import acceleration_violations, request_id_problem
from serving_common.load_extras import extras_violations
from serving_common.logs import REQUEST_ID_METADATA, request_ids_of
from serving_common.protocol import image_seed
from serving_common.server import Context
from worker_service.config import Limits
from worker_service.controller import INFO_TIMEOUT_S, ModelController
from worker_service.encoding import encode_images
from worker_service.image_inputs import decoded_inputs, encoded_bytes, give_back_memory, input_sizes
from worker_service.image_parameters import ImageParameters
from worker_service.lifecycle import Lifecycle
from worker_service.result_cache import ResultCache
from worker_service.runners import RunnerPool
from worker_service.scheduling.admission import Admission, AdmissionQueue
from worker_service.scheduling.estimate import too_long
from worker_service.scheduling.jobs import Finished, Job
from worker_service.status import StatusReporter
from worker_service.validation import (
    NormalizedRequest,
    ValidationError,
    adapter_kind_violations,
    adapter_name_violations,
    normalize,
    parallel_violations,
    request_id_violations,
    required_text,
    tag_violations,
)
from worker_service.video_encoding import MIME_TYPES as VIDEO_MIME_TYPES
from worker_service.video_encoding import encode_video, frames_array

logger = logging.getLogger(__name__)

ATTACH_TIMEOUT_S = 60.0
ATTACH_MARGIN_S = 0.2  # answered before the caller's deadline, with what happened
# Room in a message for a ResultChunk's other fields and the gRPC framing beside its data.
CHUNK_OVERHEAD_BYTES = 1024

OnProgress = Callable[[worker_pb2.ProgressEvent], None]


def _sends_frames(request: NormalizedRequest) -> bool:
    """Whether the response holds the video's raw frames (RAW's data, or return_frames)."""
    return request.video and (request.return_frames or request.output_format == worker_pb2.OUTPUT_FORMAT_RAW)


def _check_size(size: int, max_bytes: int, what: str) -> None:
    """RESOURCE_EXHAUSTED when ``size`` bytes are more than a unary response may hold."""
    if size > max_bytes:
        raise ServiceError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                           f"{what} would be {size} bytes, more than one message holds (--max-message-bytes "
                           f"{max_bytes}); use GenerateStream, which sends a video in chunks")


def adapter_unloaded(name: str) -> ServiceError:
    """What a request accepted with adapter ``name`` ends with once the adapter is unloaded."""
    return failed_precondition(f"adapter {name!r} was unloaded after this request was accepted; "
                               "nothing was generated")


class WorkerServicer(worker_pb2_grpc.WorkerServiceServicer):
    def __init__(self, limits: Limits, lifecycle: Lifecycle, controller: ModelController, pool: RunnerPool,
                 queue: AdmissionQueue, status: StatusReporter, max_message_bytes: int,
                 stream_chunk_bytes: int, image_parameters: bool, results: ResultCache) -> None:
        self._limits = limits
        self._results = results  # exact repeats of seeded requests (--result-cache-bytes)
        self._image_parameters = image_parameters  # written into every image (off: --no-image-parameters)
        self._max_message_bytes = max_message_bytes
        self._chunk_bytes = max(min(stream_chunk_bytes, max_message_bytes - CHUNK_OVERHEAD_BYTES), 1)
        self._lifecycle = lifecycle
        self._controller = controller
        self._pool = pool
        self._queue = queue
        self._status = status

    @reports_errors
    async def Generate(self, request: worker_pb2.GenerateRequest,
                       context: Context) -> worker_pb2.GenerateResponse:
        self._take_caller_id(request, context)
        response = worker_pb2.GenerateResponse()
        async for event in self._generate(request, carried(context.time_remaining()), stream=False,
                                          max_bytes=self._max_message_bytes):
            response = event.done
        return response

    def _take_caller_id(self, request: worker_pb2.GenerateRequest, context: Context) -> None:
        """A request that names no id of its own takes the caller's ``x-request-id`` metadata (a
        gateway's or a service mesh's, as the HTTP API takes its header); one no request could carry
        is INVALID_ARGUMENT naming it."""
        caller_id = "" if request.request_id else request_ids_of(context.invocation_metadata())
        if not caller_id:
            return
        problem = request_id_problem(caller_id, self._limits.max_request_id_chars)
        if problem is not None:
            raise invalid_argument({REQUEST_ID_METADATA: problem})
        request.request_id = caller_id

    async def generate(self, request: worker_pb2.GenerateRequest, timeout: float | None,
                       on_progress: OnProgress | None = None) -> worker_pb2.GenerateResponse:
        """Generate for in-process callers (the OpenAI HTTP API): the same validation, queue and
        encoding, the whole result in the response whatever its size (the caller bounds its own
        memory). ``timeout`` is the seconds left of the caller's deadline (None: no deadline), clamped
        to what gRPC carries to the runner; ``on_progress`` gets every progress event of every phase.
        Raises ServiceError; cancelling the calling task cancels the request."""
        response = worker_pb2.GenerateResponse()
        async for event in self._generate(request, carried(timeout), stream=on_progress is not None):
            if event.HasField("progress") and on_progress is not None:
                on_progress(event.progress)
            elif event.HasField("done"):
                response = event.done
        return response

    @reports_errors
    async def GenerateStream(self, request: worker_pb2.GenerateStreamRequest,
                             context: Context) -> AsyncIterator[worker_pb2.GenerateStreamResponse]:
        self._take_caller_id(request.request, context)
        async for event in self._generate(request.request, time_left(context), stream=True, prefix="request."):
            if event.HasField("done"):
                for chunk in self._chunks(event.done):
                    yield worker_pb2.GenerateStreamResponse(chunk=chunk)
            yield event

    def _chunks(self, response: worker_pb2.GenerateResponse) -> Iterator[worker_pb2.ResultChunk]:
        """Each video's data, then its frames, as chunks of at most ``--stream-chunk-bytes``, taken
        out of ``response`` (its videos' data and frames are left empty)."""
        for index, video in enumerate(response.videos):
            for is_frames, data in ((False, video.data), (True, video.frames)):
                for offset in range(0, len(data), self._chunk_bytes):
                    yield worker_pb2.ResultChunk(video_index=index, frames=is_frames, offset=offset,
                                                 data=data[offset:offset + self._chunk_bytes], total_bytes=len(data))
            video.data = video.frames = b""

    async def _generate(self, request: worker_pb2.GenerateRequest, remaining: float | None, stream: bool,
                        prefix: str = "", max_bytes: int | None = None,
                        ) -> AsyncIterator[worker_pb2.GenerateStreamResponse]:
        """Events of one request: queued, started and progress (streams only), then done.

        A request with an image or mask is admitted first (queue room, ``--max-input-bytes``), so
        that a refused one costs no decoding; what its admission holds is freed when its call ends.
        ``max_bytes``: the most the response may hold (unary Generate's message limit), checked before
        the request runs where its raw frames alone are more, and after encoding. ``prefix`` goes
        before the names of bad fields (``request.`` on GenerateStream). A seeded request the result
        cache holds is answered from it, without queueing (``result_cache``)."""
        received = time.monotonic()
        # Each read of a bytes field is a copy, dropped here: the decoding threads read the image out
        # of the message when they take it, so a request waiting for one holds only its message's.
        input_bytes = encoded_bytes(request)
        admission: Admission | None = None
        try:
            if input_bytes:
                admission = self._queue.admit(input_bytes)
            normalized = await self._normalized(request, prefix, remaining, stream)
            if max_bytes is not None:
                _check_size(normalized.frame_bytes if _sends_frames(normalized) else 0, max_bytes, "raw frames")
            lookup = self._results.lookup(normalized, seeded=request.HasField("seed"))
            cached = self._results.get(lookup) if lookup is not None else None
            if cached is not None:
                self._queue.check_open()
                response = self._from_memory(cached, normalized.request_id, received)
            else:
                job = Job(normalized, deadline=None if remaining is None else received + remaining, stream=stream)
                self._queue.submit(job, admission)
                logger.debug("request %s queued at %d", normalized.request_id, job.position)
                try:
                    while True:
                        event = await job.events.get()
                        if isinstance(event, ServiceError):
                            raise event
                        if isinstance(event, Finished):
                            break
                        yield event
                    response = worker_pb2.GenerateResponse()
                    async for encoded in self._respond(job, event, received):
                        if isinstance(encoded, worker_pb2.GenerateResponse):
                            response = encoded
                        elif stream:
                            yield worker_pb2.GenerateStreamResponse(progress=encoded)
                finally:
                    self._queue.release(job)
                if lookup is not None:
                    self._results.put(lookup, response)
            if max_bytes is not None:
                _check_size(response.ByteSize(), max_bytes, "the result")
        finally:
            if admission is not None:
                self._queue.leave(admission)
            if input_bytes:
                give_back_memory()  # its inputs, admitted or refused, are garbage once the call ends
        yield worker_pb2.GenerateStreamResponse(done=response)

    @staticmethod
    def _from_memory(cached: worker_pb2.GenerateResponse, request_id: str,
                     received: float) -> worker_pb2.GenerateResponse:
        """A result cache hit as the response of ``request_id``: the bytes sent before, timings with
        ``total_ms`` alone (nothing queued, ran or was encoded)."""
        cached.request_id = request_id
        cached.timings.total_ms = (time.monotonic() - received) * 1000
        logger.info("request %s answered from the result cache: %d image(s), %d video(s), %.1f ms", request_id,
                    len(cached.images), len(cached.videos), cached.timings.total_ms)
        return cached

    async def _normalized(self, request: worker_pb2.GenerateRequest, prefix: str,
                          time_left: float | None, stream: bool) -> NormalizedRequest:
        """The request validated, with its input images (if any) decoded and fitted to its size;
        raises INVALID_ARGUMENT naming each bad field (a name registered as another kind of adapter
        included), FAILED_PRECONDITION naming a ControlNet or IP-Adapter not registered, or
        INVALID_ARGUMENT naming its size and steps when the runner cannot finish it in the
        ``time_left`` before its deadline. Nothing is decoded before those checks (headers
        excepted)."""
        try:
            sizes = await input_sizes(request, self._limits.max_size, prefix)
            normalized = normalize(request, self._limits, self._queue.active, field_prefix=prefix,
                                   model=self._lifecycle.model, adapters=self._controller.adapter_kinds(),
                                   image_size=sizes.image if sizes else None,
                                   mask_size=sizes.mask if sizes else None, streamed=stream,
                                   control_sizes=sizes.controls if sizes else (),
                                   prompt_sizes=sizes.prompts if sizes else ())
            refusal = too_long(normalized, self._lifecycle.model, time_left, prefix)
            if refusal is not None:
                raise refusal
            if sizes is None:
                return normalized
            decoded = await decoded_inputs(request, self._limits.max_size, (normalized.width, normalized.height),
                                           prefix)
        except ValidationError as error:
            raise invalid_argument(error.violations) from None
        registered = self._controller.adapter_names()
        unloaded = [name for name in normalized.adapter_names() if name not in registered]
        if unloaded:  # while its images were decoded
            raise adapter_unloaded(unloaded[0])
        return dataclasses.replace(normalized, image=decoded.image, mask_image=decoded.mask,
                                   control_images=decoded.controls, prompt_images=decoded.prompts)

    async def _respond(self, job: Job, finished: Finished,
                       received: float) -> AsyncIterator[worker_pb2.ProgressEvent | worker_pb2.GenerateResponse]:
        """The response to a finished job, its images or videos encoded; a video's ENCODING progress
        events come first."""
        request = job.request
        encode_start = time.monotonic()
        images: list[worker_pb2.Image] = []
        videos: list[worker_pb2.Video] = []
        if request.video:
            for index, frames in enumerate(finished.frames):
                data = b""
                async for encoded in encode_video(frames_array(frames, request.num_frames, request.width,
                                                               request.height), request.output_format, request.fps):
                    if isinstance(encoded, bytes):
                        data = encoded
                    else:
                        yield encoded
                videos.append(worker_pb2.Video(
                    data=data, mime_type=VIDEO_MIME_TYPES[request.output_format], width=request.width,
                    height=request.height, num_frames=request.num_frames, fps=request.fps,
                    seed=image_seed(request.seed, index), frames=bytes(frames) if request.return_frames else b""))
        else:
            seeds = [image_seed(request.seed, i) for i in range(len(finished.output.images))]
            parameters = ([ImageParameters.of(request, self._lifecycle.model, seed) for seed in seeds]
                          if self._image_parameters else None)
            try:
                images = await encode_images(list(finished.output.images), request.output_format, seeds, parameters)
            except ValueError as error:
                raise ServiceError(grpc.StatusCode.INTERNAL, str(error)) from None
        done = time.monotonic()
        model = self._lifecycle.model
        logger.info("request %s done: %d image(s), %d video(s) of %d frames, %dx%d, %d steps, %.0f ms",
                    request.request_id, len(images), len(videos), request.num_frames, request.width, request.height,
                    request.num_inference_steps, (done - received) * 1000)
        yield worker_pb2.GenerateResponse(
            request_id=request.request_id,
            images=images,
            videos=videos,
            weights_version=finished.weights_version,
            model=model.source if model else "",
            timings=worker_pb2.Timings(
                queue_ms=((job.started_at or encode_start) - job.admitted_at) * 1000,
                execute_ms=finished.execute_ms,
                encode_ms=(done - encode_start) * 1000,
                total_ms=(done - received) * 1000,
                runner=finished.runner_timings,
                transfer_ms=finished.transfer_ms,
            ),
        )

    @reports_errors
    async def Cancel(self, request: worker_pb2.CancelRequest,
                     context: Context) -> worker_pb2.CancelResponse:
        violations = request_id_violations(request.request_id, self._limits)
        if violations:
            raise invalid_argument(violations)
        was = self._queue.cancel(request.request_id, ServiceError(
            grpc.StatusCode.CANCELLED, f"request {request.request_id} was cancelled by Cancel"))
        if was is None:
            raise ServiceError(grpc.StatusCode.NOT_FOUND, f"no queued or running request {request.request_id}")
        logger.info("request %s cancelled by Cancel while %s", request.request_id, was)
        return worker_pb2.CancelResponse(was=was)

    @reports_errors
    async def Init(self, request: worker_pb2.InitRequest,
                   context: Context) -> worker_pb2.InitResponse:
        violations = required_text("model", request.model, "must name a built-in model or a model directory")
        if request.dtype not in common_pb2.Dtype.values():
            violations.append(("dtype", f"unknown dtype {request.dtype}"))
        violations.extend(acceleration_violations(request.acceleration))
        violations.extend(parallel_violations(request.parallel))
        violations.extend(extras_violations(request.component_overrides, request.fused_adapters))
        if violations:
            raise invalid_argument(violations)
        info = await self._controller.init(request.model, request.dtype, request.acceleration, request.parallel,
                                           time_left(context), on_dropped=self._end_queued_using,
                                           overrides=request.component_overrides, fused=request.fused_adapters)
        return worker_pb2.InitResponse(model=info.model, weights_version=info.weights_version)

    @reports_errors
    async def Sleep(self, request: worker_pb2.SleepRequest,
                    context: Context) -> worker_pb2.SleepResponse:
        level = request.level or 1
        violations = tag_violations(request.tags, self._limits)
        if level not in (1, 2):
            violations.append(("level", f"must be 1 or 2, got {level}"))
        if violations:
            raise invalid_argument(violations)
        reply = await self._controller.sleep(level, list(request.tags), time_left(context))
        return worker_pb2.SleepResponse(freed_bytes=reply.freed_bytes,
                                        weight_bytes_released=reply.weight_bytes_released,
                                        sleeping_components=self._lifecycle.sleeping_components)

    @reports_errors
    async def WakeUp(self, request: worker_pb2.WakeUpRequest,
                     context: Context) -> worker_pb2.WakeUpResponse:
        violations = tag_violations(request.tags, self._limits)
        if violations:
            raise invalid_argument(violations)
        reply = await self._controller.wake_up(list(request.tags), time_left(context))
        return worker_pb2.WakeUpResponse(weight_bytes_restored=reply.weight_bytes_restored,
                                         sleeping_components=self._lifecycle.sleeping_components)

    @reports_errors
    async def LoadWeights(self, request: worker_pb2.LoadWeightsRequest,
                          context: Context) -> worker_pb2.LoadWeightsResponse:
        violations = required_text("path", request.path, "must name a .safetensors file or directory")
        if violations:
            raise invalid_argument(violations)
        reply = await self._controller.load_weights(request.path, time_left(context))
        return worker_pb2.LoadWeightsResponse(loaded_names=reply.loaded_names,
                                              weights_version=reply.weights_version)

    @reports_errors
    async def GetStatus(self, request: worker_pb2.GetStatusRequest,
                        context: Context) -> worker_pb2.GetStatusResponse:
        return self._status.status()

    @reports_errors
    async def AttachRunner(self, request: worker_pb2.AttachRunnerRequest,
                           context: Context) -> worker_pb2.AttachRunnerResponse:
        violations = required_text("target", request.target, "must be host:port or unix:/path")
        if violations:
            raise invalid_argument(violations)
        remaining = time_left(context)
        timeout = ATTACH_TIMEOUT_S if remaining is None else remaining - ATTACH_MARGIN_S
        runner = await self._pool.attach(request.target, timeout)
        return worker_pb2.AttachRunnerResponse(runner=self._status.runner_status(runner))

    @reports_errors
    async def DetachRunner(self, request: worker_pb2.DetachRunnerRequest,
                           context: Context) -> worker_pb2.DetachRunnerResponse:
        violations = required_text("target", request.target, "must name an attached runner")
        if violations:
            raise invalid_argument(violations)
        await self._pool.detach(request.target, request.drain)
        return worker_pb2.DetachRunnerResponse()

    @reports_errors
    async def LoadAdapter(self, request: worker_pb2.LoadAdapterRequest,
                          context: Context) -> worker_pb2.LoadAdapterResponse:
        violations = [*adapter_name_violations(request.name),
                      *required_text("path", request.path, "must name a .safetensors LoRA file or a directory "
                                                           "holding one, or a ControlNet or IP-Adapter directory"),
                      *adapter_kind_violations(request.kind)]
        if violations:
            raise invalid_argument(violations)
        adapter = await self._controller.load_adapter(request.name, request.path, request.pin, time_left(context),
                                                      kind=request.kind)
        logger.info("adapter %s (%s) loaded from %s: %s", request.name, KIND_NAMES[request.kind], request.path,
                    list(adapter.components))
        return worker_pb2.LoadAdapterResponse(adapter=self._status.adapter(request.name) or adapter)

    @reports_errors
    async def UnloadAdapter(self, request: worker_pb2.UnloadAdapterRequest,
                            context: Context) -> worker_pb2.UnloadAdapterResponse:
        violations = adapter_name_violations(request.name)
        if violations:
            raise invalid_argument(violations)
        await self._controller.unload_adapter(request.name, time_left(context),
                                              on_unloaded=self._end_queued_using)
        logger.info("adapter %s unloaded", request.name)
        return worker_pb2.UnloadAdapterResponse()

    def _end_queued_using(self, names: Collection[str]) -> None:
        """Ends the queued requests that name one of the adapters ``names`` (a LoRA, a ControlNet or
        an IP-Adapter), just unloaded (by UnloadAdapter, or Init of another model): valid when
        accepted, they can no longer run, and none of them has started (the batches running were
        waited for)."""
        ended = 0
        for job in self._queue.jobs:  # a copy: cancelling takes the job out of the queue
            used = next((name for name in job.request.adapter_names() if name in names), None)
            if used is not None:
                self._queue.cancel(job.request.request_id, adapter_unloaded(used))
                ended += 1
        if ended:
            logger.info("adapter(s) %s unloaded: %d queued request(s) using them ended", ", ".join(names), ended)

    @reports_errors
    async def ListAdapters(self, request: worker_pb2.ListAdaptersRequest,
                           context: Context) -> worker_pb2.ListAdaptersResponse:
        # Which adapters are resident changes with every batch: asked of the runners now.
        await asyncio.gather(*(self._pool.refresh_info(r, INFO_TIMEOUT_S) for r in self._pool.reachable()))
        return worker_pb2.ListAdaptersResponse(adapters=self._status.adapters(), max_adapters=self._pool.max_adapters())

    @reports_errors
    async def PushWeights(self, requests: AsyncIterator[bytes],  # serialized, as received (receive_gate)
                          context: Context) -> worker_pb2.PushWeightsResponse:
        reply = await self._controller.push_weights(requests, time_left(context))
        logger.info("pushed %d tensors (%d bytes): weights version %s, checksum %s", len(reply.loaded_names),
                    reply.bytes_received, reply.weights_version, reply.checksum[:12])
        return reply

    @reports_errors
    async def GetWeightsChecksum(self, request: worker_pb2.GetWeightsChecksumRequest,
                                 context: Context) -> worker_pb2.GetWeightsChecksumResponse:
        reply = await self._controller.weights_checksum(time_left(context))
        return worker_pb2.GetWeightsChecksumResponse(checksum=reply.checksum, weights_version=reply.weights_version)
