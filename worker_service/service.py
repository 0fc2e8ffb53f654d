"""The WorkerService servicer: validates, admits, relays events and encodes; lifecycle RPCs delegate."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator

import grpc

from clients.rpc import bad_request
from diffusion.v1 import common_pb2, worker_pb2, worker_pb2_grpc

from .config import Limits
from .controller import ModelController
from .encoding import encode_images
from .errors import RpcFailure
from .lifecycle import Lifecycle
from .runner_client import RunnerClient
from .scheduler import Finished, Job, Scheduler
from .validation import ValidationError, normalize

logger = logging.getLogger(__name__)


class WorkerServicer(worker_pb2_grpc.WorkerServiceServicer):
    def __init__(self, limits: Limits, lifecycle: Lifecycle, controller: ModelController,
                 scheduler: Scheduler) -> None:
        self._limits = limits
        self._lifecycle = lifecycle
        self._controller = controller
        self._scheduler = scheduler

    async def Generate(self, request: worker_pb2.GenerateRequest,
                       context: grpc.aio.ServicerContext) -> worker_pb2.GenerateResponse:
        response = worker_pb2.GenerateResponse()
        async for event in self._generate(request, context, stream=False):
            response = event.done
        return response

    async def GenerateStream(self, request: worker_pb2.GenerateStreamRequest,
                             context: grpc.aio.ServicerContext) -> AsyncIterator[worker_pb2.GenerateStreamResponse]:
        async for event in self._generate(request.request, context, stream=True):
            yield event

    async def _generate(self, request: worker_pb2.GenerateRequest, context: grpc.aio.ServicerContext,
                        stream: bool) -> AsyncIterator[worker_pb2.GenerateStreamResponse]:
        """Events of one request: queued, started and progress (streams only), then done."""
        received = time.monotonic()
        try:
            normalized = normalize(request, self._limits, self._scheduler.active_ids,
                                   field_prefix="request." if stream else "")
        except ValidationError as error:
            await context.abort_with_status(bad_request(error.violations))
        remaining = context.time_remaining()
        job = Job(normalized, deadline=None if remaining is None else received + remaining, stream=stream)
        try:
            self._scheduler.submit(job)
        except RpcFailure as failure:
            await failure.abort(context)
        logger.debug("request %s queued at %d", normalized.request_id, job.position)
        try:
            while True:
                event = await job.events.get()
                if isinstance(event, RpcFailure):
                    await event.abort(context)
                if isinstance(event, Finished):
                    break
                yield event
            try:
                response = await self._respond(job, event, received)
            except RpcFailure as failure:
                await failure.abort(context)
        finally:
            self._scheduler.release(job)
        yield worker_pb2.GenerateStreamResponse(done=response)

    async def _respond(self, job: Job, finished: Finished, received: float) -> worker_pb2.GenerateResponse:
        request = job.request
        encode_start = time.monotonic()
        seeds = [request.image_seed(i) for i in range(len(finished.output.images))]
        try:
            images = await encode_images(list(finished.output.images), request.output_format, seeds)
        except ValueError as error:
            raise RpcFailure(grpc.StatusCode.INTERNAL, str(error)) from None
        done = time.monotonic()
        model = self._lifecycle.model
        logger.info("request %s done: %d image(s) %dx%d, %d steps, %.0f ms", request.request_id,
                    len(images), request.width, request.height, request.steps, (done - received) * 1000)
        return worker_pb2.GenerateResponse(
            request_id=request.request_id,
            images=images,
            weights_version=finished.weights_version,
            model=model.source if model else "",
            timings=worker_pb2.Timings(
                queue_ms=((job.started_at or encode_start) - job.admitted_at) * 1000,
                execute_ms=finished.execute_ms,
                encode_ms=(done - encode_start) * 1000,
                total_ms=(done - received) * 1000,
            ),
        )

    async def Cancel(self, request: worker_pb2.CancelRequest,
                     context: grpc.aio.ServicerContext) -> worker_pb2.CancelResponse:
        if not request.request_id:
            await context.abort_with_status(bad_request({"request_id": "must not be empty"}))
        was = self._scheduler.cancel(request.request_id, RpcFailure(
            grpc.StatusCode.CANCELLED, f"request {request.request_id} was cancelled by Cancel"))
        if was is None:
            await context.abort(grpc.StatusCode.NOT_FOUND,
                                f"no queued or running request {request.request_id}")
        logger.info("request %s cancelled by Cancel while %s", request.request_id, was)
        return worker_pb2.CancelResponse(was=was)

    async def Init(self, request: worker_pb2.InitRequest,
                   context: grpc.aio.ServicerContext) -> worker_pb2.InitResponse:
        violations = {}
        if not request.model:
            violations["model"] = "must name a built-in model or a model directory"
        if request.dtype not in common_pb2.Dtype.values():
            violations["dtype"] = f"unknown dtype {request.dtype}"
        if violations:
            await context.abort_with_status(bad_request(violations))
        try:
            info = await self._controller.init(request.model, request.dtype)
        except RpcFailure as failure:
            await failure.abort(context)
        return worker_pb2.InitResponse(model=info.model, weights_version=info.weights_version)

    async def Sleep(self, request: worker_pb2.SleepRequest,
                    context: grpc.aio.ServicerContext) -> worker_pb2.SleepResponse:
        level = request.level or 1
        if level not in (1, 2):
            await context.abort_with_status(bad_request({"level": f"must be 1 or 2, got {level}"}))
        try:
            reply = await self._controller.sleep(level, list(request.tags))
        except RpcFailure as failure:
            await failure.abort(context)
        return worker_pb2.SleepResponse(freed_bytes=reply.freed_bytes,
                                        weight_bytes_released=reply.weight_bytes_released,
                                        sleeping_components=self._lifecycle.sleeping_components)

    async def WakeUp(self, request: worker_pb2.WakeUpRequest,
                     context: grpc.aio.ServicerContext) -> worker_pb2.WakeUpResponse:
        try:
            reply = await self._controller.wake_up(list(request.tags))
        except RpcFailure as failure:
            await failure.abort(context)
        return worker_pb2.WakeUpResponse(weight_bytes_restored=reply.weight_bytes_restored,
                                         sleeping_components=self._lifecycle.sleeping_components)

    async def LoadWeights(self, request: worker_pb2.LoadWeightsRequest,
                          context: grpc.aio.ServicerContext) -> worker_pb2.LoadWeightsResponse:
        if not request.path:
            await context.abort_with_status(bad_request({"path": "must name a .safetensors file or directory"}))
        try:
            reply = await self._controller.load_weights(request.path)
        except RpcFailure as failure:
            await failure.abort(context)
        return worker_pb2.LoadWeightsResponse(loaded_names=reply.loaded_names,
                                              weights_version=reply.weights_version)

    async def GetStatus(self, request: worker_pb2.GetStatusRequest,
                        context: grpc.aio.ServicerContext) -> worker_pb2.GetStatusResponse:
        lifecycle = self._lifecycle
        model = lifecycle.model
        return worker_pb2.GetStatusResponse(
            state=lifecycle.state,
            message=lifecycle.message,
            model=model,
            sleep_level=model.sleep_level if model and lifecycle.sleeping_components else 0,
            sleeping_components=lifecycle.sleeping_components,
            runners=[self._runner_status(r) for r in self._controller.runners],
            queue_depth=self._scheduler.queue_depth,
            requests_in_flight=self._scheduler.in_flight,
            weights_version=lifecycle.weights_version,
        )

    def _runner_status(self, runner: RunnerClient) -> worker_pb2.RunnerStatus:
        return worker_pb2.RunnerStatus(target=runner.target, connected=runner.connected, info=runner.info,
                                       restarts=runner.restarts, ready=runner.ready,
                                       requests_in_flight=self._scheduler.in_flight_on(runner))

    async def AttachRunner(self, request: worker_pb2.AttachRunnerRequest,
                           context: grpc.aio.ServicerContext) -> worker_pb2.AttachRunnerResponse:
        if not request.target:
            await context.abort_with_status(bad_request({"target": "must be host:port or unix:/path"}))
        remaining = context.time_remaining()
        try:
            runner = await self._scheduler.attach(request.target, 60.0 if remaining is None else remaining - 0.2)
        except RpcFailure as failure:
            await failure.abort(context)
        return worker_pb2.AttachRunnerResponse(runner=self._runner_status(runner))

    async def DetachRunner(self, request: worker_pb2.DetachRunnerRequest,
                           context: grpc.aio.ServicerContext) -> worker_pb2.DetachRunnerResponse:
        if not request.target:
            await context.abort_with_status(bad_request({"target": "must name an attached runner"}))
        try:
            await self._scheduler.detach(request.target, request.drain)
        except RpcFailure as failure:
            await failure.abort(context)
        return worker_pb2.DetachRunnerResponse()
