"""The RunnerService servicer: validates, runs device work serialized off the event loop, builds protos."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import aclosing
from pathlib import Path
from typing import TypeVar, cast

import grpc
import torch

from diffusion.v1 import common_pb2, runner_pb2, runner_pb2_grpc
from runner_service.adapters import Adapter, AdapterSet, check_name
from runner_service.denoising.engine import StepEngine
from runner_service.denoising.prompt_cache import PromptCache
from runner_service.execution import BatchResult, stream_batch, task_name, validate_batch
from runner_service.limits import DEFAULT_MAX_ADAPTERS, DEFAULT_PROMPT_CACHE_BYTES, BatchLimits
from runner_service.loaded_model import (
    DeviceOutOfMemory,
    LoadedModel,
    ModelSource,
    WeightUpdate,
    check_source,
    load_model,
)
from runner_service.model_roots import ModelRoots
from runner_service.pipeline_adapter import Capabilities
from runner_service.platforms import MemoryUsage, Platform
from runner_service.sleep import SleepController, SleepReport, check_tags
from runner_service.weight_push import receive_push
from runner_service.weights import apply_tensors, load_weights, read_tensors, weights_checksum
from serving_common.errors import ServiceError, failed_precondition, invalid_argument, reports_errors
from serving_common.input_rules import check_text
from serving_common.logs import request_ids_of
from serving_common.protocol import DTYPE_NAMES, DTYPES

logger = logging.getLogger(__name__)

T = TypeVar("T")

# LoadWeights reads at most this much by default, or twice the model's parameters if more.
MIN_WEIGHTS_BYTES = 64 * 1024 * 1024


def _memory(usage: MemoryUsage) -> common_pb2.MemoryInfo:
    return common_pb2.MemoryInfo(used_bytes=usage.used_bytes, total_bytes=usage.total_bytes)


def _update(update: WeightUpdate) -> common_pb2.WeightUpdate:
    return common_pb2.WeightUpdate(digest=update.digest, components=sorted(update.components), pushed=update.pushed)


def _capabilities(capabilities: Capabilities) -> common_pb2.ModelCapabilities:
    return common_pb2.ModelCapabilities(
        negative_prompt=capabilities.negative_prompt,
        guidance=f"GUIDANCE_KIND_{capabilities.guidance.value}",
        default_guidance_scale=capabilities.default_guidance,
        step_events=capabilities.step_events,
        step_callback=capabilities.step_callback,
        stages=capabilities.stages,
        tasks=[f"TASK_{task}" for task in capabilities.tasks],
        true_cfg=capabilities.true_cfg,
        default_true_cfg_scale=capabilities.default_true_cfg,
    )


def _adapter_info(adapter: Adapter) -> common_pb2.AdapterInfo:
    return common_pb2.AdapterInfo(name=adapter.name, path=str(adapter.path), pinned=adapter.pinned,
                                  components=adapter.components, digest=adapter.digest, resident=adapter.resident,
                                  parameter_bytes=adapter.parameter_bytes, requests=adapter.requests)


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


def _describe(error: BaseException) -> str:
    if isinstance(error, ServiceError):
        return error.message or "; ".join(f"{field}: {why}" for field, why in error.violations)
    return f"{type(error).__name__}: {error}"


class CallWatch:
    """Whether the caller of a device operation still waits for its answer.

    Device work runs in a thread that cannot be interrupted; it calls ``before_change`` right
    before it changes the model, which raises (and logs) once the call has ended, by its
    deadline or a cancellation, so an operation its caller was told failed never takes effect
    afterwards.
    """

    def __init__(self, method: str, context: grpc.aio.ServicerContext | None = None) -> None:
        self.method = method
        self._ended = threading.Event()
        self._deadline: float | None = None
        remaining = context.time_remaining() if context is not None else None
        if remaining is not None:
            self._deadline = time.monotonic() + remaining

    def end(self) -> None:
        """The call is over (cancelled, or its deadline passed): the work must not take effect."""
        self._ended.set()

    def before_change(self) -> None:
        if self._ended.is_set():
            code, reason = grpc.StatusCode.CANCELLED, "the call was cancelled or timed out"
        elif self._deadline is not None and time.monotonic() >= self._deadline:
            code, reason = grpc.StatusCode.DEADLINE_EXCEEDED, "the call's deadline passed"
        else:
            return
        logger.warning("%s abandoned before changing the model: %s; nothing changed", self.method, reason)
        raise ServiceError(code, f"{self.method} abandoned: {reason}; nothing changed")


class RunnerServicer(runner_pb2_grpc.RunnerServiceServicer):
    """Owns the model on one platform. One lock serializes everything that touches the device,
    so LoadWeights, Sleep and LoadModel always fall between executions."""

    def __init__(self, platform: Platform, model_cache: Path | None = None, roots: ModelRoots | None = None,
                 limits: BatchLimits | None = None, max_weights_bytes: int = 0,
                 max_adapters: int = DEFAULT_MAX_ADAPTERS, step_batching: bool = True,
                 prompt_cache_bytes: int = DEFAULT_PROMPT_CACHE_BYTES) -> None:
        self.platform = platform
        self.model_cache = model_cache
        self.roots = roots or ModelRoots()
        self.limits = limits or BatchLimits()
        self.max_weights_bytes = max_weights_bytes
        self.max_adapters = max_adapters
        self.instance_id = uuid.uuid4().hex
        self.model: LoadedModel | None = None
        self.sleeper = SleepController(platform)
        self._device = asyncio.Lock()
        # --batching step: text-to-image on a model with a standard loop joins a running batch.
        self.step_batching = step_batching
        # Every device operation runs on this one thread: each thread calling torch gets its own OpenMP
        # team of threads, and teams left spinning beside the working one slow it down.
        self._device_thread = ThreadPoolExecutor(1, thread_name_prefix="device")
        self.engine = StepEngine(self._device, self._require_model, self.limits, PromptCache(prompt_cache_bytes),
                                 self._device_thread)

    def _require_model(self) -> LoadedModel:
        if self.model is None:
            raise failed_precondition("no model loaded; call LoadModel")
        return self.model

    def weights_budget(self, model: LoadedModel) -> int:
        """Bytes one LoadWeights may read: ``--max-weights-bytes``, or twice the model's parameters
        and at least ``MIN_WEIGHTS_BYTES``."""
        return self.max_weights_bytes or max(2 * model.parameter_bytes, MIN_WEIGHTS_BYTES)

    def _adapter_set(self) -> AdapterSet:
        """A new model's adapters: none yet, their files read like LoadWeights' (roots, size cap)."""
        def read(path: Path) -> tuple[dict[str, torch.Tensor], str]:
            return read_tensors(path, self.roots, self.max_weights_bytes or MIN_WEIGHTS_BYTES)

        return AdapterSet(self.max_adapters, read)

    def info(self) -> common_pb2.RunnerInfo:
        info = common_pb2.RunnerInfo(
            instance_id=self.instance_id,
            platform=self.platform.name,
            device_name=self.platform.device_name(),
            memory=_memory(self.platform.memory()),
        )
        info.max_adapters = self.max_adapters
        cache = self.engine.cache.stats()
        info.prompt_cache.CopyFrom(common_pb2.PromptCacheStats(hits=cache.hits, misses=cache.misses,
                                                               entries=cache.entries, bytes=cache.bytes,
                                                               max_bytes=cache.max_bytes))
        model = self.model
        if model is not None:
            info.adapters.extend(_adapter_info(adapter) for adapter in model.adapters.registered.values())
            info.weights_version = model.weights_version
            if model.checksum_cache[0] == model.weights_version:
                info.weights_checksum = model.checksum_cache[1]
            info.weight_updates.extend(_update(update) for update in model.weight_updates)
            info.model.CopyFrom(common_pb2.ModelInfo(
                source=model.source,
                pipeline_class=type(model.pipeline).__name__,
                # The generated stubs type enum fields as Dtype, the table as plain ints.
                dtype=cast(common_pb2.Dtype, DTYPES[model.dtype_name]),
                sleep_level=max((c.sleep_level for c in model.components.values()), default=0),
                components=[
                    common_pb2.ComponentInfo(name=c.name, class_name=type(c.module).__name__,
                                             parameter_count=c.parameter_count, bytes=c.bytes, asleep=c.asleep)
                    for c in model.components.values()
                ],
                min_size=model.capabilities.min_size,
                size_multiple=model.capabilities.size_multiple,
                max_size=model.capabilities.max_size,
                capabilities=_capabilities(model.capabilities),
            ))
            info.model.capabilities.step_batching = self._steps(model)
        return info

    async def _on_device(self, watch: CallWatch, work: Callable[[], T]) -> T:
        """Runs ``work`` in a thread holding the device lock.

        When the call ends first (cancelled, or past its deadline), the thread cannot be stopped:
        it is told through ``watch``, so it changes nothing, and the lock is held until it is done,
        so nothing else runs on the device alongside it.
        """
        async with self.engine.exclusive(), self._device:
            task = asyncio.ensure_future(asyncio.get_running_loop().run_in_executor(self._device_thread, work))
            try:
                return await asyncio.shield(task)
            except asyncio.CancelledError:
                watch.end()
                while not task.done():
                    try:
                        await asyncio.wait({task})
                    except asyncio.CancelledError:
                        continue
                if not task.cancelled() and task.exception() is None:
                    logger.warning("%s finished after its call ended", watch.method)
                raise

    async def load(self, source: str, dtype_name: str | None, watch: CallWatch | None = None) -> None:
        """Loads a model in place of the one loaded before, which stays loaded and serving if this
        fails; no dtype: the platform's default."""
        watch = watch or CallWatch("LoadModel")
        # Checked before the device is locked or anything is unloaded (a built-in may be built here).
        checked = await asyncio.to_thread(check_source, source, self.model_cache, self.roots)
        await self._on_device(watch, lambda: self._replace_model(checked, dtype_name, watch))

    def _free_memory(self) -> None:
        """Hands back what models released (callers drop their references first)."""
        gc.collect()
        self.platform.empty_cache()
        self.platform.release_host_memory()

    def _replace_model(self, checked: ModelSource, dtype_name: str | None, watch: CallWatch) -> None:
        """Loads the new model alongside the current one and swaps them; where the device cannot
        hold both, unloads the current one first and puts it back if the new one fails."""
        if self.model is not None and not self.platform.fits_alongside(2 * checked.file_bytes):
            logger.warning("%s may not fit in memory next to %s: unloading that first", checked.source,
                           self.model.source)
            self._replace_unloading_first(checked, dtype_name, watch)
            return
        too_big = ""
        try:
            model = load_model(checked, dtype_name, self.platform, self._adapter_set())
        except DeviceOutOfMemory as error:
            if self.model is None:
                raise failed_precondition(f"{checked.source!r} does not fit in the device's memory: {error}") from None
            too_big = str(error)
        if too_big:
            logger.warning("%s does not fit next to %s (%s): unloading that first", checked.source,
                           self.model.source if self.model else "-", too_big)
            self._replace_unloading_first(checked, dtype_name, watch)
            return
        try:
            watch.before_change()
        except ServiceError:
            del model
            self._free_memory()
            raise
        previous, self.model = self.model, model
        del model
        if previous is not None:
            self.sleeper.forget(previous)
            del previous
            self._free_memory()

    def _replace_unloading_first(self, checked: ModelSource, dtype_name: str | None, watch: CallWatch) -> None:
        previous = self.model
        if previous is None:
            raise AssertionError("nothing to unload")
        source, dtype = previous.source, previous.dtype_name
        self.sleeper.forget(previous)
        self.model = None
        del previous
        self._free_memory()
        code, failure = grpc.StatusCode.FAILED_PRECONDITION, ""
        model: LoadedModel | None = None
        try:
            model = load_model(checked, dtype_name, self.platform, self._adapter_set())
            watch.before_change()
        except Exception as error:  # noqa: BLE001 - reported with what became of the previous model
            logger.warning("loading %s failed after unloading %s", checked.source, source, exc_info=True)
            if isinstance(error, ServiceError):
                code = error.code
            failure = _describe(error)
        if not failure and model is not None:
            self.model = model
            return
        # Outside the except block nothing holds what the failed load allocated any more.
        model = None
        self._free_memory()
        raise ServiceError(code, f"{failure}; {self._reload(source, dtype)}")

    def _reload(self, source: str, dtype_name: str) -> str:
        """Loads the model that was unloaded for one that then failed; says how that went."""
        try:
            self.model = load_model(check_source(source, self.model_cache, self.roots), dtype_name, self.platform,
                                    self._adapter_set())
        except Exception as error:  # noqa: BLE001 - the runner stays up, with no model
            logger.error("cannot reload the previous model %s: %s", source, _describe(error))
            return f"the previous model {source!r} could not be loaded back ({_describe(error)}); no model is loaded"
        logger.warning("reloaded the previous model %s from its source; its weight updates were dropped", source)
        return f"the previous model {source!r} was loaded back from its source, without its weight updates"

    def _steps(self, model: LoadedModel | None) -> bool:
        """Whether the model's text-to-image requests run step-batched."""
        return self.step_batching and model is not None and model.loop is not None

    @reports_errors
    async def GetInfo(self, request: runner_pb2.GetInfoRequest,
                      context: grpc.aio.ServicerContext) -> runner_pb2.GetInfoResponse:
        return runner_pb2.GetInfoResponse(info=self.info())

    @reports_errors
    async def LoadModel(self, request: runner_pb2.LoadModelRequest,
                        context: grpc.aio.ServicerContext) -> runner_pb2.LoadModelResponse:
        if not request.source:
            raise invalid_argument({"source": "required"}, "source is empty")
        check_text([("source", request.source)])
        if request.dtype and request.dtype not in DTYPE_NAMES:
            raise invalid_argument({"dtype": f"{request.dtype} is not a known dtype"})
        await self.load(request.source, DTYPE_NAMES.get(request.dtype), CallWatch("LoadModel", context))
        return runner_pb2.LoadModelResponse(info=self.info())

    @reports_errors
    async def Execute(
        self, request: runner_pb2.ExecuteRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[runner_pb2.ExecuteResponse]:
        items = list(request.items)
        validate_batch(items, self.limits, self.model)  # again under the lock, on the model then
        request_ids = [item.request_id for item in items]
        # The worker names the batch's requests in x-request-id; fall back to the items' own ids.
        log_ids = {"request_id": request_ids_of(context.invocation_metadata()) or ",".join(request_ids)}
        logger.info("execute %d request(s), %d image(s), %dx%d, %d steps", len(items),
                    sum(item.num_images for item in items), items[0].width, items[0].height,
                    items[0].num_inference_steps, extra=log_ids)
        async with contextlib.AsyncExitStack() as stack:
            if self._steps(self.model) and task_name(items[0]) == "TEXT_TO_IMAGE":
                events = self.engine.execute(items, request.progress)
            else:
                # A request-level batch gets the device once a step-level batch has drained.
                await stack.enter_async_context(self.engine.exclusive())
                events = stream_batch(items, self._device, self._require_model, request.progress, self.limits,
                                      self._device_thread)
            await stack.enter_async_context(aclosing(events))
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
        check_tags(tags)
        watch = CallWatch("Sleep", context)

        def work() -> SleepReport:
            model = self._require_model()
            if request.level == 2 and model.adapters.resident():
                # Level 2 reloads weights by their checkpoint names: take peft's wrappers off first.
                if model.asleep_components():
                    raise failed_precondition("wake the model before a level-2 sleep while adapters are resident")
                watch.before_change()
                model.adapters.evict_all(model.pipeline)
            return self.sleeper.sleep(model, request.level, tags, watch.before_change)

        report = await self._on_device(watch, work)
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
        check_tags(tags)
        watch = CallWatch("WakeUp", context)
        restored = await self._on_device(
            watch, lambda: self.sleeper.wake(self._require_model(), tags, watch.before_change)
        )
        return runner_pb2.RunnerServiceWakeUpResponse(weight_bytes_restored=restored, info=self.info())

    @reports_errors
    async def LoadWeights(
        self, request: runner_pb2.RunnerServiceLoadWeightsRequest, context: grpc.aio.ServicerContext
    ) -> runner_pb2.RunnerServiceLoadWeightsResponse:
        if not request.path:
            raise invalid_argument({"path": "required"}, "path is empty")
        check_text([("path", request.path)])
        path = self.roots.check(request.path, "path")
        watch = CallWatch("LoadWeights", context)

        def work() -> runner_pb2.RunnerServiceLoadWeightsResponse:
            model = self._require_model()
            loaded = load_weights(model, path, self.roots, self.weights_budget(model), request.expected_digest,
                                  watch.before_change)
            response = runner_pb2.RunnerServiceLoadWeightsResponse(loaded_names=loaded.names,
                                                                  weights_version=loaded.weights_version)
            if loaded.update is not None:
                response.update.CopyFrom(_update(loaded.update))
            return response

        response = await self._on_device(watch, work)
        logger.info("loaded %d tensors from %s; weights version %s", len(response.loaded_names), request.path,
                    response.weights_version)
        return response

    @reports_errors
    async def LoadAdapter(self, request: runner_pb2.RunnerServiceLoadAdapterRequest,
                          context: grpc.aio.ServicerContext) -> runner_pb2.RunnerServiceLoadAdapterResponse:
        check_name(request.name)
        if not request.path:
            raise invalid_argument({"path": "required"}, "path is empty")
        check_text([("path", request.path)])
        path = self.roots.check(request.path, "path")
        watch = CallWatch("LoadAdapter", context)

        def work() -> Adapter:
            model = self._require_model()
            model.require_awake()
            return model.adapters.register(model.pipeline, request.name, path, request.pin,
                                           request.expected_digest, watch.before_change)

        adapter = await self._on_device(watch, work)
        return runner_pb2.RunnerServiceLoadAdapterResponse(adapter=_adapter_info(adapter), info=self.info())

    @reports_errors
    async def UnloadAdapter(self, request: runner_pb2.RunnerServiceUnloadAdapterRequest,
                            context: grpc.aio.ServicerContext) -> runner_pb2.RunnerServiceUnloadAdapterResponse:
        check_name(request.name)
        watch = CallWatch("UnloadAdapter", context)

        def work() -> None:
            model = self._require_model()
            watch.before_change()
            model.adapters.unregister(model.pipeline, request.name)

        await self._on_device(watch, work)
        return runner_pb2.RunnerServiceUnloadAdapterResponse(info=self.info())

    @reports_errors
    async def PushWeights(self, requests: AsyncIterator[runner_pb2.RunnerServicePushWeightsRequest],
                          context: grpc.aio.ServicerContext) -> runner_pb2.RunnerServicePushWeightsResponse:
        # Received (network-bound) without the device lock; applied under it, between batches.
        tensors, digest, received = await receive_push(requests, self.weights_budget(self._require_model()))
        watch = CallWatch("PushWeights", context)

        def work() -> runner_pb2.RunnerServicePushWeightsResponse:
            model = self._require_model()
            loaded = apply_tensors(model, tensors, digest, watch.before_change, pushed=True)
            response = runner_pb2.RunnerServicePushWeightsResponse(
                loaded_names=loaded.names, weights_version=loaded.weights_version,
                checksum=weights_checksum(model), bytes_received=received)
            if loaded.update is not None:
                response.update.CopyFrom(_update(loaded.update))
            return response

        response = await self._on_device(watch, work)
        logger.info("pushed %d tensors (%d bytes); weights version %s, checksum %s", len(response.loaded_names),
                    received, response.weights_version, response.checksum[:12])
        return response

    @reports_errors
    async def GetWeightsChecksum(
        self, request: runner_pb2.RunnerServiceGetWeightsChecksumRequest, context: grpc.aio.ServicerContext
    ) -> runner_pb2.RunnerServiceGetWeightsChecksumResponse:
        watch = CallWatch("GetWeightsChecksum", context)

        def work() -> runner_pb2.RunnerServiceGetWeightsChecksumResponse:
            model = self._require_model()
            return runner_pb2.RunnerServiceGetWeightsChecksumResponse(checksum=weights_checksum(model),
                                                                      weights_version=model.weights_version)

        return await self._on_device(watch, work)
