"""The RunnerService servicer: device work serialized, run off the event loop in a thread."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from functools import wraps
from pathlib import Path
from typing import TypeVar

import grpc

from clients.logging_setup import request_ids_of
from clients.rpc import bad_request
from diffusion.v1 import common_pb2, runner_pb2, runner_pb2_grpc
from runner_service.errors import RunnerError, failed_precondition
from runner_service.execution import run_batch, validate_batch
from runner_service.model import LoadedModel, load_model
from runner_service.paths import ModelRoots
from runner_service.platforms import MemoryUsage, Platform
from runner_service.sleep import SleepController
from runner_service.weights import load_weights

logger = logging.getLogger(__name__)

DTYPE_NAMES = {
    common_pb2.DTYPE_UNSPECIFIED: "",
    common_pb2.DTYPE_FLOAT32: "float32",
    common_pb2.DTYPE_FLOAT16: "float16",
    common_pb2.DTYPE_BFLOAT16: "bfloat16",
}
DTYPE_ENUMS = {name: enum for enum, name in DTYPE_NAMES.items() if name}

T = TypeVar("T")
_DONE = object()


async def _abort(context: grpc.aio.ServicerContext, error: RunnerError) -> None:
    if error.code == grpc.StatusCode.INVALID_ARGUMENT and error.violations:
        await context.abort_with_status(bad_request(error.violations, error.message))
    await context.abort(error.code, error.message)


def reports_errors(handler: Callable[..., Awaitable[T]]) -> Callable[..., Awaitable[T]]:
    """Turns a RunnerError raised by a unary handler into its gRPC status."""

    @wraps(handler)
    async def wrapper(self: RunnerServicer, request: object, context: grpc.aio.ServicerContext) -> T:
        try:
            return await handler(self, request, context)
        except RunnerError as error:
            await _abort(context, error)

    return wrapper


def _memory(usage: MemoryUsage) -> common_pb2.MemoryInfo:
    return common_pb2.MemoryInfo(used_bytes=usage.used_bytes, total_bytes=usage.total_bytes)


class RunnerServicer(runner_pb2_grpc.RunnerServiceServicer):
    """Owns the model on one platform. One lock serializes everything that touches the device,
    so LoadWeights, Sleep and LoadModel always fall between executions."""

    def __init__(self, platform: Platform, model_cache: Path | None = None, roots: ModelRoots | None = None) -> None:
        self.platform = platform
        self.model_cache = model_cache
        self.roots = roots or ModelRoots()
        self.instance_id = uuid.uuid4().hex
        self.model: LoadedModel | None = None
        self.sleeper = SleepController(platform)
        self._device = asyncio.Lock()

    def _require_model(self) -> LoadedModel:
        if self.model is None:
            raise failed_precondition("no model loaded; call LoadModel")
        return self.model

    def info(self) -> common_pb2.RunnerInfo:
        info = common_pb2.RunnerInfo(
            instance_id=self.instance_id,
            platform=self.platform.name,
            device_name=self.platform.device_name(),
            memory=_memory(self.platform.memory()),
        )
        model = self.model
        if model is not None:
            info.weights_version = model.weights_version
            info.model.CopyFrom(common_pb2.ModelInfo(
                source=model.source,
                pipeline_class=type(model.pipeline).__name__,
                dtype=DTYPE_ENUMS[str(model.dtype).removeprefix("torch.")],
                sleep_level=max((c.sleep_level for c in model.components.values()), default=0),
                components=[
                    common_pb2.ComponentInfo(name=c.name, class_name=type(c.module).__name__,
                                             parameter_count=c.parameter_count, bytes=c.bytes, asleep=c.asleep)
                    for c in model.components.values()
                ],
            ))
        return info

    async def _on_device(self, work: Callable[[], T]) -> T:
        async with self._device:
            return await asyncio.to_thread(work)

    async def load(self, source: str, dtype_name: str) -> None:
        """Loads a model, replacing (and releasing) the one loaded before."""

        def load() -> None:
            if self.model is not None:
                self.sleeper.forget(self.model)
                self.model = None
                self.platform.empty_cache()
            self.model = load_model(source, dtype_name, self.platform, self.model_cache, self.roots)

        await self._on_device(load)

    async def GetInfo(self, request: runner_pb2.GetInfoRequest, context: grpc.aio.ServicerContext):
        return runner_pb2.GetInfoResponse(info=self.info())

    @reports_errors
    async def LoadModel(self, request: runner_pb2.LoadModelRequest, context: grpc.aio.ServicerContext):
        if not request.source:
            raise RunnerError(grpc.StatusCode.INVALID_ARGUMENT, "source is empty", {"source": "required"})

        await self.load(request.source, DTYPE_NAMES[request.dtype])
        return runner_pb2.LoadModelResponse(info=self.info())

    async def Execute(
        self, request: runner_pb2.ExecuteRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[runner_pb2.ExecuteResponse]:
        items = list(request.items)
        try:
            validate_batch(items)
        except RunnerError as error:
            await _abort(context, error)
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        cancelled = threading.Event()
        request_ids = [item.request_id for item in items]
        # The worker names the batch's requests in x-request-id; fall back to the items' own ids.
        log_ids = {"request_id": request_ids_of(context.invocation_metadata()) or ",".join(request_ids)}
        logger.info("execute %d request(s), %d image(s), %dx%d, %d steps", len(items),
                    sum(item.num_images or 1 for item in items), items[0].width, items[0].height,
                    items[0].num_inference_steps, extra=log_ids)

        def on_step(step: int, total: int, elapsed_ms: float) -> None:
            if request.progress:
                event = runner_pb2.ExecuteProgress(request_ids=request_ids, step=step, total_steps=total,
                                                   elapsed_ms=elapsed_ms)
                loop.call_soon_threadsafe(events.put_nowait, event)

        def execute() -> list:
            try:
                model = self._require_model()
                model.require_awake()
                return run_batch(model, items, on_step, cancelled)
            finally:
                loop.call_soon_threadsafe(events.put_nowait, _DONE)

        async with self._device:
            started = time.perf_counter()
            work = asyncio.ensure_future(asyncio.to_thread(execute))
            try:
                while (event := await events.get()) is not _DONE:
                    yield runner_pb2.ExecuteResponse(progress=event)
                outputs = await work
            except RunnerError as error:
                await _abort(context, error)
            except Exception as error:
                logger.exception("execution of %s failed", request_ids, extra=log_ids)
                await context.abort(grpc.StatusCode.INTERNAL, f"execution failed: {error!r}")
            finally:
                # On cancellation the denoising thread stops at its next step boundary; the
                # device is released only once it has.
                cancelled.set()
                await asyncio.wait({work})
                if not work.cancelled():
                    work.exception()  # retrieved: a cancelled run ends in ExecutionCancelled
        result = runner_pb2.ExecuteResult(
            weights_version=self.model.weights_version,
            execute_ms=(time.perf_counter() - started) * 1000,
        )
        logger.info("executed in %.0f ms", result.execute_ms, extra=log_ids)
        by_request: dict[str, runner_pb2.ExecuteOutput] = {}
        for item in items:
            by_request[item.request_id] = result.outputs.add(request_id=item.request_id)
        for output in outputs:
            height, width, channels = output.pixels.shape
            by_request[output.request_id].images.add(
                pixels=output.pixels.tobytes(), width=width, height=height, channels=channels, seed=output.seed
            )
        yield runner_pb2.ExecuteResponse(result=result)

    @reports_errors
    async def Sleep(self, request: runner_pb2.RunnerServiceSleepRequest, context: grpc.aio.ServicerContext):
        tags = list(request.tags)
        report = await self._on_device(
            lambda: self.sleeper.sleep(self._require_model(), request.level, tags)
        )
        return runner_pb2.RunnerServiceSleepResponse(
            freed_bytes=report.freed_bytes,
            weight_bytes_released=report.weight_bytes_released,
            memory_before=_memory(report.before),
            memory_after=_memory(report.after),
            info=self.info(),
        )

    @reports_errors
    async def WakeUp(self, request: runner_pb2.RunnerServiceWakeUpRequest, context: grpc.aio.ServicerContext):
        tags = list(request.tags)
        restored = await self._on_device(lambda: self.sleeper.wake(self._require_model(), tags))
        return runner_pb2.RunnerServiceWakeUpResponse(weight_bytes_restored=restored, info=self.info())

    @reports_errors
    async def LoadWeights(
        self, request: runner_pb2.RunnerServiceLoadWeightsRequest, context: grpc.aio.ServicerContext
    ):
        if not request.path:
            raise RunnerError(grpc.StatusCode.INVALID_ARGUMENT, "path is empty", {"path": "required"})
        path = self.roots.check(request.path, "path")
        names = await self._on_device(lambda: load_weights(self._require_model(), path))
        logger.info("loaded %d tensors from %s; weights version %s", len(names), request.path,
                    self.model.weights_version)
        return runner_pb2.RunnerServiceLoadWeightsResponse(loaded_names=names,
                                                          weights_version=self.model.weights_version)
