"""A RunnerService with no torch, for fast tests of the worker's logic: in process, or as a process.

It answers like a runner (model info, progress per step, deterministic pixels from the seed and the
weights version) in microseconds, and can be told to fail: each status in ``execute_failures`` ends
one Execute (the next ones, in order) after ``fail_after_steps`` steps, as a runner that died
mid-batch would.

As a process (``python -m tests.fake_runner --listen ADDR [--step-s S]``, or
``harness.processes.start_fake_runner``) it stands in for a real runner where the behaviour under
test is the worker's: kill -9 and SIGSTOP hit a process that starts in a second, not one that
imports torch. Like a real runner it logs "stopped ID after step N: the call ended" when a call ends
mid-run, and "loaded SOURCE" for each LoadModel; a source that is a path to no directory is
refused, as a runner refuses it.

Acceleration: every model is offered ``OFFER``; LoadModel refuses a method outside it as a runner
does (INVALID_ARGUMENT naming ``acceleration.<field>``, the model loaded before kept) and echoes the
one it took in ModelInfo.acceleration. With a step cache it reports RunnerInfo.cache: each image
is one row a step, skipped at every even step after the warm-up when its threshold is above 0.

Video (``video=True``): the model serves text-to-image and text-to-video (``VIDEO``); a video item's
Execute reports its denoising steps, one decoding step, then its frames in ExecuteFrames of
``FRAMES_PER_MESSAGE`` frames (every pixel of frame i is ``pixel(seed) + i``), then the result.
``frame_shift`` moves every first_frame it sends, as a faulty runner's would be; ``video_open``, when
set up, holds every step of a video until it is set (images still run).

Adapters: LoadAdapter registers any path that exists, of the kind asked (its digest is the path's),
UnloadAdapter forgets it, and RunnerInfo lists them. ``adapter_kinds`` (None: no capabilities for
them) makes the model report capabilities (text-to-image and image-to-image) whose adapter_kinds
are those, as a family that takes ControlNets or IP-Adapters does.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Iterator, Sequence
from pathlib import Path

import grpc

from diffusion.v1 import common_pb2, runner_pb2, runner_pb2_grpc
from serving_common.errors import invalid_argument
from serving_common.protocol import RUNNER_SERVICE, image_seed
from serving_common.server import SERVING, create_server

COMPONENTS = ("unet", "vae", "text_encoder")
OFFER = common_pb2.AccelerationOffer(cache_methods=["first_block_cache"], quantizations=["int8-weight-only"],
                                     attention_backends=["native"], compile=True)
logger = logging.getLogger("fake_runner")
VIDEO = common_pb2.VideoCapabilities(frame_step=4, min_frames=1, max_frames=17, default_frames=5, min_fps=1,
                                     max_fps=30, default_fps=8)
FRAMES_PER_MESSAGE = 2


class FakeRunner(runner_pb2_grpc.RunnerServiceServicer):
    def __init__(self, step_s: float = 0.0, step_batching: bool = False, video: bool = False,
                 step_schedule: str = "all", adapter_kinds: Sequence[int] | None = None) -> None:
        self.step_s = step_s
        self.step_batching = step_batching  # the model's capability: the worker sends Executes side by side
        self.step_schedule = step_schedule  # "budget": the worker schedules it by compute
        self.video = video
        self.video_open: asyncio.Event | None = None  # when set up, every step of a video waits for it
        self.frame_shift = 0
        self.steps_open: asyncio.Event | None = None  # when set up, every step waits for it
        # A step waiting for steps_open is one a real runner cannot interrupt: the device stays busy
        # (RunnerInfo.device_busy_s) until it opens, after its call ended too.
        self.busy_since: float | None = None
        self.info_calls = 0
        self.instance_id = uuid.uuid4().hex
        self.model: common_pb2.ModelInfo | None = None
        self.executes: list[runner_pb2.ExecuteRequest] = []
        self.ran_to_end: list[str] = []  # the request ids of each Execute that ran every step
        self.stopped: list[str] = []  # ... and of each that ended early because its call did
        self.execute_failures: list[grpc.StatusCode] = []
        self.fail_after_steps = 0
        self.updates: list[common_pb2.WeightUpdate] = []
        self.cache: common_pb2.CacheStats | None = None  # the step cache's rows, with one
        self.adapter_kinds = adapter_kinds
        self.adapters: dict[str, common_pb2.AdapterInfo] = {}

    async def uninterruptible_step(self, gate: asyncio.Event) -> None:
        """A step that goes on until ``gate`` opens, whether its call ends or not."""
        self.busy_since = time.monotonic()

        async def step() -> None:
            await gate.wait()
            self.busy_since = None

        await asyncio.shield(asyncio.ensure_future(step()))

    def info(self) -> common_pb2.RunnerInfo:
        info = common_pb2.RunnerInfo(instance_id=self.instance_id, platform="fake",
                                     memory=common_pb2.MemoryInfo(used_bytes=1, total_bytes=2),
                                     weight_updates=self.updates, step_schedule=self.step_schedule,
                                     device_busy_s=0 if self.busy_since is None else time.monotonic() - self.busy_since,
                                     adapters=self.adapters.values())
        if self.model is not None:
            info.model.CopyFrom(self.model)
            info.weights_version = hashlib.sha256(
                "".join(u.digest for u in self.updates).encode()).hexdigest()[:16]
        if self.cache is not None:
            info.cache.CopyFrom(self.cache)
        return info

    def pixel(self, seed: int) -> int:
        """The value of every pixel of the image of ``seed``: loaded weights change it, as on a runner."""
        shift = 1 + int(self.info().weights_version[:2], 16) % 255 if self.updates else 0
        return (seed + shift) % 256

    async def GetInfo(self, request: runner_pb2.GetInfoRequest,
                      context: grpc.aio.ServicerContext) -> runner_pb2.GetInfoResponse:
        self.info_calls += 1
        return runner_pb2.GetInfoResponse(info=self.info())

    async def LoadModel(self, request: runner_pb2.LoadModelRequest,
                        context: grpc.aio.ServicerContext) -> runner_pb2.LoadModelResponse:
        if request.source.startswith("/") and not Path(request.source).is_dir():
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"no model directory at {request.source}")
        asked = request.acceleration
        refused = {f"acceleration.{field}": f"FakePipeline cannot take {value!r} here; offered: {', '.join(names)}"
                   for field, value, names in (("cache", asked.cache, OFFER.cache_methods),
                                               ("quantization", asked.quantization, OFFER.quantizations),
                                               ("attention_backend", asked.attention_backend,
                                                OFFER.attention_backends))
                   if value and value not in names}
        if refused:
            await invalid_argument(refused).abort(context)
        self.model = common_pb2.ModelInfo(source=request.source, pipeline_class="FakePipeline", components=[
            common_pb2.ComponentInfo(name=name, bytes=1000) for name in COMPONENTS], min_size=8, size_multiple=8,
            acceleration=asked, acceleration_offer=OFFER)
        if self.step_batching:  # capabilities stay unset otherwise: the worker then checks no model terms
            self.model.capabilities.MergeFrom(common_pb2.ModelCapabilities(
                negative_prompt=True, step_batching=True, step_batching_tasks=[common_pb2.TASK_TEXT_TO_IMAGE]))
        if self.adapter_kinds is not None:
            self.model.capabilities.MergeFrom(common_pb2.ModelCapabilities(
                negative_prompt=True, tasks=[common_pb2.TASK_TEXT_TO_IMAGE, common_pb2.TASK_IMAGE_TO_IMAGE],
                adapter_kinds=self.adapter_kinds))
        if self.video:
            self.model.capabilities.MergeFrom(common_pb2.ModelCapabilities(
                negative_prompt=True, tasks=[common_pb2.TASK_TEXT_TO_IMAGE, common_pb2.TASK_TEXT_TO_VIDEO],
                video=VIDEO))
        self.updates = []
        self.adapters = {}
        self.cache = common_pb2.CacheStats() if asked.cache else None
        logger.info("loaded %s", request.source)
        return runner_pb2.LoadModelResponse(info=self.info())

    async def Execute(self, request: runner_pb2.ExecuteRequest,
                      context: grpc.aio.ServicerContext) -> AsyncIterator[runner_pb2.ExecuteResponse]:
        self.executes.append(request)
        first = request.items[0]
        ids = [item.request_id for item in request.items]
        failure = self.execute_failures.pop(0) if self.execute_failures else None
        started = time.perf_counter()
        done = 0
        try:
            for step in range(1, first.num_inference_steps + 1):
                if failure is not None and step > self.fail_after_steps:
                    await context.abort(failure, "fake runner failure")
                await asyncio.sleep(self.step_s)
                if self.steps_open is not None and not self.steps_open.is_set():
                    await self.uninterruptible_step(self.steps_open)
                if self.video_open is not None and first.task == common_pb2.TASK_TEXT_TO_VIDEO:
                    await self.video_open.wait()
                self.count_cache_rows(request.items, step)
                done = step
                yield runner_pb2.ExecuteResponse(progress=runner_pb2.ExecuteProgress(
                    request_ids=ids, step=step, total_steps=first.num_inference_steps,
                    elapsed_ms=(time.perf_counter() - started) * 1000, phase=common_pb2.PROGRESS_PHASE_DENOISING))
        except (asyncio.CancelledError, GeneratorExit):  # in a step, or between two: the call ended
            logger.info("stopped %s after step %d: the call ended", ",".join(ids), done)
            self.stopped.append(",".join(ids))
            raise
        self.ran_to_end.append(",".join(ids))
        result = runner_pb2.ExecuteResult(weights_version=self.info().weights_version, execute_ms=1.0)
        for item in request.items:
            output = result.outputs.add(request_id=item.request_id)
            if item.task == common_pb2.TASK_TEXT_TO_VIDEO:
                for response in self.video_frames(item):
                    yield response
                output.videos.add(width=item.width, height=item.height, num_frames=item.num_frames, seed=item.seed)
                continue
            for index in range(item.num_images):
                seed = image_seed(item.seed, index)
                output.images.add(pixels=bytes([self.pixel(seed)]) * (item.width * item.height * 3),
                                  width=item.width, height=item.height, channels=3, seed=seed)
        yield runner_pb2.ExecuteResponse(result=result)

    def video_frames(self, item: runner_pb2.ExecuteItem) -> Iterator[runner_pb2.ExecuteResponse]:
        """A video's decoding step, then its frames (frame i: every pixel ``pixel(seed) + i``)."""
        yield runner_pb2.ExecuteResponse(progress=runner_pb2.ExecuteProgress(
            request_ids=[item.request_id], step=1, total_steps=1, phase=common_pb2.PROGRESS_PHASE_DECODING))
        frame_bytes = item.width * item.height * 3
        for first in range(0, item.num_frames, FRAMES_PER_MESSAGE):
            count = min(FRAMES_PER_MESSAGE, item.num_frames - first)
            pixels = b"".join(bytes([(self.pixel(item.seed) + i) % 256]) * frame_bytes
                              for i in range(first, first + count))
            yield runner_pb2.ExecuteResponse(frames=runner_pb2.ExecuteFrames(
                request_id=item.request_id, first_frame=first + self.frame_shift, pixels=pixels))

    def count_cache_rows(self, items: Sequence[runner_pb2.ExecuteItem], step: int) -> None:
        if self.cache is None or self.model is None:
            return
        acceleration = self.model.acceleration
        for item in items:
            threshold = item.cache_threshold if item.HasField("cache_threshold") else acceleration.cache_threshold
            self.cache.rows += item.num_images
            if threshold > 0 and step > acceleration.cache_warmup_steps and step % 2 == 0:
                self.cache.skipped_rows += item.num_images

    @staticmethod
    async def check_tags(tags: Sequence[str], context: grpc.aio.ServicerContext) -> None:
        """Refuses tags that name no component, as a runner does."""
        unknown = sorted(set(tags) - set(COMPONENTS))
        if unknown:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"unknown component tags {unknown}")

    async def Sleep(self, request: runner_pb2.RunnerServiceSleepRequest,
                    context: grpc.aio.ServicerContext) -> runner_pb2.RunnerServiceSleepResponse:
        assert self.model is not None
        await self.check_tags(request.tags, context)
        tags = set(request.tags) or set(COMPONENTS)
        for component in self.model.components:
            if component.name in tags:
                component.asleep = True
        self.model.sleep_level = request.level
        if request.level == 2:
            self.updates = [u for u in self.updates if not set(u.components) & tags]
        freed = 1000 * len(tags)
        return runner_pb2.RunnerServiceSleepResponse(freed_bytes=freed, weight_bytes_released=freed, info=self.info())

    async def WakeUp(self, request: runner_pb2.RunnerServiceWakeUpRequest,
                     context: grpc.aio.ServicerContext) -> runner_pb2.RunnerServiceWakeUpResponse:
        assert self.model is not None
        await self.check_tags(request.tags, context)
        for component in self.model.components:
            if not request.tags or component.name in request.tags:
                component.asleep = False
        if not any(component.asleep for component in self.model.components):
            self.model.sleep_level = 0
        return runner_pb2.RunnerServiceWakeUpResponse(info=self.info())

    async def LoadWeights(self, request: runner_pb2.RunnerServiceLoadWeightsRequest,
                          context: grpc.aio.ServicerContext) -> runner_pb2.RunnerServiceLoadWeightsResponse:
        # The path, and the file's bytes where it exists: a file changed on disk has a new digest.
        path = Path(request.path)
        digest = hashlib.sha256(request.path.encode() + (path.read_bytes() if path.is_file() else b"")).hexdigest()
        if request.expected_digest and request.expected_digest != digest:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "digest differs")
        update = common_pb2.WeightUpdate(digest=digest, components=["unet"])
        self.updates.append(update)
        return runner_pb2.RunnerServiceLoadWeightsResponse(
            loaded_names=["unet.conv_in.weight"], weights_version=self.info().weights_version, update=update)


    async def LoadAdapter(self, request: runner_pb2.RunnerServiceLoadAdapterRequest,
                          context: grpc.aio.ServicerContext) -> runner_pb2.RunnerServiceLoadAdapterResponse:
        if not Path(request.path).exists():
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"no adapter at {request.path}")
        digest = hashlib.sha256(request.path.encode()).hexdigest()
        if request.expected_digest and request.expected_digest != digest:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "digest differs")
        adapter = common_pb2.AdapterInfo(name=request.name, path=request.path, pinned=request.pin, digest=digest,
                                         components=["unet"], resident=True, kind=request.kind)
        self.adapters[request.name] = adapter
        logger.info("registered adapter %s of kind %d", request.name, request.kind)
        return runner_pb2.RunnerServiceLoadAdapterResponse(adapter=adapter, info=self.info())

    async def UnloadAdapter(self, request: runner_pb2.RunnerServiceUnloadAdapterRequest,
                            context: grpc.aio.ServicerContext) -> runner_pb2.RunnerServiceUnloadAdapterResponse:
        self.adapters.pop(request.name, None)
        return runner_pb2.RunnerServiceUnloadAdapterResponse(info=self.info())


async def serve_fake_runner(runner: FakeRunner, target: str) -> grpc.aio.Server:
    """Starts ``runner`` on ``target`` (``unix:/path`` in the tests) and reports it SERVING."""
    server, health = create_server(target, [RUNNER_SERVICE])
    runner_pb2_grpc.add_RunnerServiceServicer_to_server(runner, server)
    await server.start()
    await health.set(RUNNER_SERVICE, SERVING)
    return server


async def _serve(target: str, step_s: float) -> None:
    server = await serve_fake_runner(FakeRunner(step_s), target)
    logger.info("fake runner serving on %s, %.3f s a step", target, step_s)
    await server.wait_for_termination()


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="A torch-free stand-in for diffusion-runner.")
    parser.add_argument("--listen", required=True, help="host:port or unix:/path")
    parser.add_argument("--step-s", type=float, default=0.0, help="seconds each denoising step takes")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    asyncio.run(_serve(args.listen, args.step_s))


if __name__ == "__main__":
    main()
