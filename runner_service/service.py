"""The RunnerService servicer: the gRPC face of the runner's ``ModelHost`` (``core.py``).

It checks each request's own fields, calls the host and answers with protos; every error, raised
here or in the host, becomes the call's status in ``reports_errors``. A video's frames go out in
``ExecuteFrames`` messages before the result, as many whole frames in each as fit in half of
``--max-message-bytes``.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Iterator
from contextlib import aclosing
from typing import cast

from diffusion.v1 import common_pb2, runner_pb2, runner_pb2_grpc
from runner_service.adapters import check_name
from runner_service.core import ModelHost
from runner_service.device_gate import CallWatch
from runner_service.execution import BatchResult, VideoOutput, model_summary
from runner_service.loaded_model import WeightUpdate
from runner_service.model_extras import LoadOptions
from runner_service.parallel import ParallelPlan
from runner_service.platforms import MemoryUsage
from runner_service.previews import Preview
from runner_service.sleep import check_tags
from runner_service.weight_push import receive_push
from serving_common.errors import invalid_argument, reports_errors
from serving_common.input_rules import AccelerationPlan, check_text
from serving_common.logs import request_ids_of
from serving_common.protocol import DTYPE_NAMES, DTYPES
from serving_common.server import Context

logger = logging.getLogger(__name__)


def _memory(usage: MemoryUsage) -> common_pb2.MemoryInfo:
    return common_pb2.MemoryInfo(used_bytes=usage.used_bytes, total_bytes=usage.total_bytes)


def _update(update: WeightUpdate) -> common_pb2.WeightUpdate:
    return common_pb2.WeightUpdate(digest=update.digest, components=sorted(update.components), pushed=update.pushed)


def _result(items: list[runner_pb2.ExecuteItem], batch: BatchResult) -> runner_pb2.ExecuteResult:
    """The batch's images (videos: their sizes, the frames went before) grouped by request, in the
    items' order (a request with none still appears)."""
    result = runner_pb2.ExecuteResult(weights_version=batch.weights_version, execute_ms=batch.execute_ms,
                                      timings=batch.timings.to_proto())
    by_request = {item.request_id: result.outputs.add(request_id=item.request_id) for item in items}
    for output in batch.outputs:
        if isinstance(output, VideoOutput):
            frames, height, width, _ = output.frames.shape
            by_request[output.request_id].videos.add(width=width, height=height, num_frames=frames, seed=output.seed)
            continue
        height, width, channels = output.pixels.shape
        by_request[output.request_id].images.add(
            pixels=output.pixels.tobytes(), width=width, height=height, channels=channels, seed=output.seed
        )
    return result


def _preview(preview: Preview) -> runner_pb2.PreviewImage:
    height, width, channels = preview.pixels.shape
    return runner_pb2.PreviewImage(
        request_id=preview.request_id, image_index=preview.image_index,
        partial_image_index=preview.partial_image_index,
        image=runner_pb2.RawImage(pixels=preview.pixels.tobytes(), width=width, height=height, channels=channels))


def _frames(batch: BatchResult, max_message_bytes: int) -> Iterator[runner_pb2.ExecuteResponse]:
    """Every frame of the batch's videos, whole frames per message, as many as fit in half of
    ``max_message_bytes`` (at least one), so a message's framing always fits beside them; each
    message's bytes are made from the frames array only when it is sent."""
    per_video: dict[str, int] = {}
    for output in batch.outputs:
        if not isinstance(output, VideoOutput):
            continue
        index = per_video.get(output.request_id, 0)
        per_video[output.request_id] = index + 1
        frames = output.frames
        step = max(1, max_message_bytes // 2 // max(1, frames[0].nbytes))
        for first in range(0, len(frames), step):
            yield runner_pb2.ExecuteResponse(frames=runner_pb2.ExecuteFrames(
                request_id=output.request_id, video_index=index, first_frame=first,
                pixels=frames[first:first + step].tobytes()))


def _watch(method: str, context: Context) -> CallWatch:
    return CallWatch(method, context.time_remaining())


def _info(host: ModelHost) -> common_pb2.RunnerInfo:
    platform = host.platform
    info = common_pb2.RunnerInfo(
        instance_id=host.instance_id,
        platform=platform.name,
        device_name=platform.device_name(),
        memory=_memory(platform.memory()),
    )
    info.devices.extend(common_pb2.DeviceInfo(rank=device.rank, device_name=device.device_name,
                                              memory=_memory(device.memory)) for device in host.devices())
    info.max_adapters = host.max_adapters
    info.device_busy_s = host.gate.work.busy_s()
    info.step_schedule = host.step_schedule
    cache = host.engine.cache.stats()
    info.prompt_cache.CopyFrom(common_pb2.PromptCacheStats(hits=cache.hits, misses=cache.misses,
                                                           entries=cache.entries, bytes=cache.bytes,
                                                           max_bytes=cache.max_bytes))
    model = host.model
    if model is not None:
        info.adapters.extend(adapter.info() for store in model.adapter_stores.values()
                             for adapter in store.registered.values())
        info.weights_version = model.weights_version
        if model.checksum_cache[0] == model.weights_version:
            info.weights_checksum = model.checksum_cache[1]
        info.weight_updates.extend(_update(update) for update in model.weight_updates)
        info.model.CopyFrom(model_summary(model, host.limits))
        info.model.MergeFrom(common_pb2.ModelInfo(
            source=model.source,
            scheduler=_scheduler_class(model.pipeline),
            revision=model.revision,
            component_overrides=model.extras.options.overrides_proto(),
            fused_adapters=model.extras.options.fused_proto(),
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
            max_size=host.largest_side(model),
            acceleration_offer=model.acceleration_offer,
            parallel=model.parallel.plan.to_proto() if model.parallel is not None else None,
            costs=[common_pb2.CostPoint(pixels=point.pixels, step_ms=point.step_ms, decode_ms=point.decode_ms)
                   for point in model.costs.points()],
            defaults=model.defaults.to_proto(),
        ))
        stepped = host.step_batched_tasks(model)
        info.model.capabilities.MergeFrom(common_pb2.ModelCapabilities(
            step_batching=bool(stepped), step_batching_tasks=[f"TASK_{task}" for task in stepped]))
        if model.row_cache is not None:
            info.cache.CopyFrom(common_pb2.CacheStats(rows=model.row_cache.rows_run,
                                                      skipped_rows=model.row_cache.rows_skipped))
    return info


def _scheduler_class(pipeline: object) -> str:
    """The class of a pipeline's scheduler; empty for one without (a combined pipeline's are inside)."""
    scheduler = getattr(pipeline, "scheduler", None)
    return "" if scheduler is None else type(scheduler).__name__


def _required_path(path: str) -> None:
    if not path:
        raise invalid_argument({"path": "required"}, "path is empty")
    check_text([("path", path)])


class RunnerServicer(runner_pb2_grpc.RunnerServiceServicer):
    """RunnerService over one ``ModelHost``."""

    def __init__(self, host: ModelHost) -> None:
        self.host = host

    @reports_errors
    async def GetInfo(self, request: runner_pb2.GetInfoRequest,
                      context: Context) -> runner_pb2.GetInfoResponse:
        return runner_pb2.GetInfoResponse(info=_info(self.host))

    @reports_errors
    async def LoadModel(self, request: runner_pb2.LoadModelRequest,
                        context: Context) -> runner_pb2.LoadModelResponse:
        if not request.source:
            raise invalid_argument({"source": "required"}, "source is empty")
        check_text([("source", request.source)])
        if request.dtype and request.dtype not in DTYPE_NAMES:
            raise invalid_argument({"dtype": f"{request.dtype} is not a known dtype"})
        plan = AccelerationPlan.from_proto(request.acceleration)
        await self.host.load(request.source, DTYPE_NAMES.get(request.dtype), _watch("LoadModel", context), plan,
                             ParallelPlan.from_proto(request.parallel),
                             LoadOptions.from_proto(request.component_overrides, request.fused_adapters))
        return runner_pb2.LoadModelResponse(info=_info(self.host))

    @reports_errors
    async def Execute(
        self, request: runner_pb2.ExecuteRequest, context: Context
    ) -> AsyncIterator[runner_pb2.ExecuteResponse]:
        items = list(request.items)
        self.host.check_batch(items)
        request_ids = [item.request_id for item in items]
        # The worker names the batch's requests in x-request-id; fall back to the items' own ids.
        log_ids = {"request_id": request_ids_of(context.invocation_metadata()) or ",".join(request_ids)}
        logger.info("execute %d request(s), %d image(s), %dx%d, %d steps", len(items),
                    sum(item.num_images for item in items), items[0].width, items[0].height,
                    items[0].num_inference_steps, extra=log_ids)
        async with aclosing(self.host.execute(items, request.progress, request.progress_interval_ms)) as events:
            async for event in events:
                if isinstance(event, BatchResult):
                    logger.info("executed in %.0f ms", event.execute_ms, extra=log_ids)
                    for frames in _frames(event, self.host.max_message_bytes):
                        yield frames
                    yield runner_pb2.ExecuteResponse(result=_result(items, event))
                else:
                    yield runner_pb2.ExecuteResponse(progress=runner_pb2.ExecuteProgress(
                        request_ids=request_ids, step=event.step, total_steps=event.total_steps,
                        elapsed_ms=event.elapsed_ms, phase=cast(common_pb2.ProgressPhase, event.phase),
                        previews=[_preview(preview) for preview in event.previews]))

    @reports_errors
    async def Sleep(self, request: runner_pb2.RunnerServiceSleepRequest,
                    context: Context) -> runner_pb2.RunnerServiceSleepResponse:
        tags = list(request.tags)
        check_tags(tags)
        report = await self.host.sleep(request.level, tags, _watch("Sleep", context))
        return runner_pb2.RunnerServiceSleepResponse(
            freed_bytes=report.freed_bytes,
            weight_bytes_released=report.weight_bytes_released,
            memory_before=_memory(report.before),
            memory_after=_memory(report.after),
            info=_info(self.host),
        )

    @reports_errors
    async def WakeUp(self, request: runner_pb2.RunnerServiceWakeUpRequest,
                     context: Context) -> runner_pb2.RunnerServiceWakeUpResponse:
        tags = list(request.tags)
        check_tags(tags)
        restored = await self.host.wake(tags, _watch("WakeUp", context))
        return runner_pb2.RunnerServiceWakeUpResponse(weight_bytes_restored=restored, info=_info(self.host))

    @reports_errors
    async def LoadWeights(
        self, request: runner_pb2.RunnerServiceLoadWeightsRequest, context: Context
    ) -> runner_pb2.RunnerServiceLoadWeightsResponse:
        _required_path(request.path)
        loaded = await self.host.load_weights(request.path, request.expected_digest, _watch("LoadWeights", context))
        logger.info("loaded %d tensors from %s; weights version %s", len(loaded.names), request.path,
                    loaded.weights_version)
        response = runner_pb2.RunnerServiceLoadWeightsResponse(loaded_names=loaded.names,
                                                              weights_version=loaded.weights_version)
        if loaded.update is not None:
            response.update.CopyFrom(_update(loaded.update))
        return response

    @reports_errors
    async def LoadAdapter(self, request: runner_pb2.RunnerServiceLoadAdapterRequest,
                          context: Context) -> runner_pb2.RunnerServiceLoadAdapterResponse:
        check_name(request.name)
        _required_path(request.path)
        adapter = await self.host.load_adapter(request.kind, request.name, request.path, request.pin,
                                               request.expected_digest, _watch("LoadAdapter", context))
        return runner_pb2.RunnerServiceLoadAdapterResponse(adapter=adapter.info(), info=_info(self.host))

    @reports_errors
    async def UnloadAdapter(self, request: runner_pb2.RunnerServiceUnloadAdapterRequest,
                            context: Context) -> runner_pb2.RunnerServiceUnloadAdapterResponse:
        check_name(request.name)
        await self.host.unload_adapter(request.name, _watch("UnloadAdapter", context))
        return runner_pb2.RunnerServiceUnloadAdapterResponse(info=_info(self.host))

    @reports_errors
    async def PushWeights(self, requests: AsyncIterator[bytes],
                          context: Context) -> runner_pb2.RunnerServicePushWeightsResponse:
        # Serialized messages, read as received (main.py registers it so). Received (network-bound)
        # without the device; applied holding it, between batches.
        tensors, digest, received = await receive_push(requests, self.host.weights_budget())
        loaded, checksum = await self.host.apply_push(tensors, digest, _watch("PushWeights", context))
        logger.info("pushed %d tensors (%d bytes); weights version %s, checksum %s", len(loaded.names),
                    received, loaded.weights_version, checksum[:12])
        response = runner_pb2.RunnerServicePushWeightsResponse(
            loaded_names=loaded.names, weights_version=loaded.weights_version, checksum=checksum,
            bytes_received=received)
        if loaded.update is not None:
            response.update.CopyFrom(_update(loaded.update))
        return response

    @reports_errors
    async def GetWeightsChecksum(
        self, request: runner_pb2.RunnerServiceGetWeightsChecksumRequest, context: Context
    ) -> runner_pb2.RunnerServiceGetWeightsChecksumResponse:
        checksum, version = await self.host.checksum(_watch("GetWeightsChecksum", context))
        return runner_pb2.RunnerServiceGetWeightsChecksumResponse(checksum=checksum, weights_version=version)
