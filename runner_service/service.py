"""The RunnerService servicer: validates, runs device work serialized off the event loop, builds protos."""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from pathlib import Path
from typing import TypeVar

import grpc

from diffusion.v1 import common_pb2, runner_pb2, runner_pb2_grpc
from runner_service.execution import BatchResult, stream_batch, validate_batch
from runner_service.loaded_model import LoadedModel, WeightUpdate, load_model
from runner_service.model_roots import ModelRoots
from runner_service.platforms import MemoryUsage, Platform
from runner_service.sleep import SleepController
from runner_service.weights import load_weights
from serving_common.errors import failed_precondition, invalid_argument, reports_errors
from serving_common.logs import request_ids_of
from serving_common.protocol import DTYPE_NAMES, DTYPES

logger = logging.getLogger(__name__)

T = TypeVar("T")


def _memory(usage: MemoryUsage) -> common_pb2.MemoryInfo:
    return common_pb2.MemoryInfo(used_bytes=usage.used_bytes, total_bytes=usage.total_bytes)


def _update(update: WeightUpdate) -> common_pb2.WeightUpdate:
    return common_pb2.WeightUpdate(digest=update.digest, components=sorted(update.components))


def _result(items: list[runner_pb2.ExecuteItem], batch: BatchResult) -> runner_pb2.ExecuteResult:
    """The batch's images grouped by request, in the items' order (a request with none still appears)."""
    result = runner_pb2.ExecuteResult(weights_version=batch.weights_version, execute_ms=batch.execute_ms)
    by_request = {item.request_id: result.outputs.add(request_id=item.request_id) for item in items}
    for output in batch.outputs:
        height, width, channels = output.pixels.shape
        by_request[output.request_id].images.add(
            pixels=output.pixels.tobytes(), width=width, height=height, channels=channels, seed=output.seed
        )
    return result


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
            info.weight_updates.extend(_update(update) for update in model.weight_updates)
            info.model.CopyFrom(common_pb2.ModelInfo(
                source=model.source,
                pipeline_class=type(model.pipeline).__name__,
                dtype=DTYPES[model.dtype_name],
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

    async def load(self, source: str, dtype_name: str | None) -> None:
        """Loads a model, replacing (and releasing) the one loaded before; no dtype: the platform's default."""

        def load() -> None:
            if self.model is not None:
                self.sleeper.forget(self.model)
                self.model = None
                self.platform.empty_cache()
            self.model = load_model(source, dtype_name, self.platform, self.model_cache, self.roots)

        await self._on_device(load)

    @reports_errors
    async def GetInfo(self, request: runner_pb2.GetInfoRequest,
                      context: grpc.aio.ServicerContext) -> runner_pb2.GetInfoResponse:
        return runner_pb2.GetInfoResponse(info=self.info())

    @reports_errors
    async def LoadModel(self, request: runner_pb2.LoadModelRequest,
                        context: grpc.aio.ServicerContext) -> runner_pb2.LoadModelResponse:
        if not request.source:
            raise invalid_argument({"source": "required"}, "source is empty")
        if request.dtype and request.dtype not in DTYPE_NAMES:
            raise invalid_argument({"dtype": f"{request.dtype} is not a known dtype"})
        await self.load(request.source, DTYPE_NAMES.get(request.dtype))
        return runner_pb2.LoadModelResponse(info=self.info())

    @reports_errors
    async def Execute(
        self, request: runner_pb2.ExecuteRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[runner_pb2.ExecuteResponse]:
        items = list(request.items)
        validate_batch(items)
        request_ids = [item.request_id for item in items]
        # The worker names the batch's requests in x-request-id; fall back to the items' own ids.
        log_ids = {"request_id": request_ids_of(context.invocation_metadata()) or ",".join(request_ids)}
        logger.info("execute %d request(s), %d image(s), %dx%d, %d steps", len(items),
                    sum(item.num_images for item in items), items[0].width, items[0].height,
                    items[0].num_inference_steps, extra=log_ids)
        async with aclosing(stream_batch(items, self._device, self._require_model, request.progress)) as events:
            async for event in events:
                if isinstance(event, BatchResult):
                    logger.info("executed in %.0f ms", event.execute_ms, extra=log_ids)
                    yield runner_pb2.ExecuteResponse(result=_result(items, event))
                else:
                    yield runner_pb2.ExecuteResponse(progress=runner_pb2.ExecuteProgress(
                        request_ids=request_ids, step=event.step, total_steps=event.total_steps,
                        elapsed_ms=event.elapsed_ms))

    @reports_errors
    async def Sleep(self, request: runner_pb2.RunnerServiceSleepRequest,
                    context: grpc.aio.ServicerContext) -> runner_pb2.RunnerServiceSleepResponse:
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
    async def WakeUp(self, request: runner_pb2.RunnerServiceWakeUpRequest,
                     context: grpc.aio.ServicerContext) -> runner_pb2.RunnerServiceWakeUpResponse:
        tags = list(request.tags)
        restored = await self._on_device(lambda: self.sleeper.wake(self._require_model(), tags))
        return runner_pb2.RunnerServiceWakeUpResponse(weight_bytes_restored=restored, info=self.info())

    @reports_errors
    async def LoadWeights(
        self, request: runner_pb2.RunnerServiceLoadWeightsRequest, context: grpc.aio.ServicerContext
    ) -> runner_pb2.RunnerServiceLoadWeightsResponse:
        if not request.path:
            raise invalid_argument({"path": "required"}, "path is empty")
        path = self.roots.check(request.path, "path")
        loaded = await self._on_device(lambda: load_weights(self._require_model(), path, request.expected_digest))
        logger.info("loaded %d tensors from %s; weights version %s", len(loaded.names), request.path,
                    loaded.weights_version)
        response = runner_pb2.RunnerServiceLoadWeightsResponse(loaded_names=loaded.names,
                                                              weights_version=loaded.weights_version)
        if loaded.update is not None:
            response.update.CopyFrom(_update(loaded.update))
        return response
