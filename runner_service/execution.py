"""Runs one batch of generation requests through the pipeline's denoising loop.

``run_batch`` is the blocking denoising call; ``stream_batch`` runs it in a thread for the
asyncio server, whose caller holds the device (``DeviceGate.exclusive``), and streams its progress.
A video task's batch is one video of one item: its denoising steps, then its VAE decode's calls
(``video_decode``), are the progress.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncGenerator, Callable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any, Protocol

import grpc
import numpy as np
import torch
from PIL import Image

from diffusion.v1 import common_pb2, runner_pb2
from runner_service.adapter_stores import registered_kinds
from runner_service.controlnets import call_controls, check_registered, control_violations, controlnet_kinds
from runner_service.device_output import ToHost, as_pixels, plain_copy
from runner_service.ip_adapters import adapter_kinds, prompt_of
from runner_service.ip_adapters import item_violations as image_prompt_violations
from runner_service.limits import BatchLimits
from runner_service.loaded_model import LoadedModel
from runner_service.overrun import Abandonment
from runner_service.phase_timing import (
    DECODE,
    DENOISE,
    TEXT_ENCODE,
    TO_HOST,
    Clock,
    PhaseSpans,
    PhaseTimes,
    returns_observed,
)
from runner_service.pipeline_adapter import Capabilities, ImageInputs, ImageRows, OutputSizeMismatch
from runner_service.platforms import TimePoint
from runner_service.previews import Preview, PreviewTarget, take_previews
from runner_service.progress_pacing import ProgressPacing
from runner_service.video_decode import DecodeOverBudget, decoding, tiles_within
from serving_common.conditioning_rules import not_a_lora, same_kind
from serving_common.errors import ServiceError, invalid_argument
from serving_common.generation_params import GenerationParams
from serving_common.input_rules import (
    VIDEO_TASKS,
    ModelTerms,
    SizeGrid,
    Violation,
    adapter_name_problem,
    adapter_scale_problem,
    count_problem,
    guidance_problem,
    negative_prompt_problem,
    num_frames_problem,
    partial_images_problem,
    request_id_problem,
    sampler_problem,
    steps_problem,
    strength_problem,
    task_inputs,
    task_label,
    task_violations,
    true_cfg_problem,
)
from serving_common.protocol import image_seed

logger = logging.getLogger(__name__)

class ExecutionCancelled(Exception):
    """Raised from the step callback to stop denoising at a step boundary."""


@dataclass(frozen=True)
class ImageOutput:
    request_id: str
    seed: int
    pixels: np.ndarray  # height x width x 3, uint8


@dataclass(frozen=True)
class VideoOutput:
    request_id: str
    seed: int
    frames: np.ndarray  # num_frames x height x width x 3, uint8


@dataclass(frozen=True)
class StepProgress:
    step: int  # 1-based; while decoding, the decoder calls done
    total_steps: int
    elapsed_ms: float
    phase: int = common_pb2.PROGRESS_PHASE_DENOISING
    previews: tuple[Preview, ...] = ()  # taken after this step (ExecuteItem.partial_images)


StepCallback = Callable[[StepProgress], None]


class StopFlag(Protocol):
    """Whether a run should stop at its next step boundary: an ``Abandonment`` on one device;
    on a runner group, rank 0's event as every rank agrees on it (``group/operations.py``)."""

    def is_set(self) -> bool: ...


@dataclass(frozen=True)
class BatchResult:
    outputs: Sequence[ImageOutput | VideoOutput]
    weights_version: str  # of the weights the batch ran with
    execute_ms: float
    timings: PhaseTimes = PhaseTimes()  # where the runner's time went (``phase_timing``)


def validate_batch(items: list[runner_pb2.ExecuteItem], limits: BatchLimits,
                   model: LoadedModel | None = None) -> None:
    """Checks each item against the request rules (``serving_common.input_rules``) within the
    runner's own limits and, given the model, what it takes; and that the items can share a batch.
    No model: only the bounds (the run fails for want of one)."""
    if not items:
        raise invalid_argument({"items": "a batch needs at least one item"})
    capabilities = model.capabilities if model is not None else None
    reported = (capabilities.size_multiple, capabilities.min_size, capabilities.max_size) \
        if capabilities is not None else (0, 0, 0)
    grid = SizeGrid.of(*reported, floor=0, ceiling=limits.max_size)
    summary = model_summary(model, limits) if model is not None else None
    terms = ModelTerms.from_model_info(summary)
    video = video_capabilities(capabilities, limits)
    violations: list[Violation] = []
    first = items[0]
    shared = GenerationParams.from_item(first)
    for index, item in enumerate(items):
        where = f"items[{index}]"
        params = GenerationParams.from_item(item)
        checked = _item_violations(item, params, limits, grid, summary, terms, video)
        violations.extend((f"{where}.{name}", why) for name, why in checked if why is not None)
        violations.extend((f"{where}.{name}", f"differs from items[0]; a batch shares "
                                              f"{', '.join(GenerationParams.shared_names())}")
                          for name in params.differences(shared))
    kinds = registered_kinds(model.adapter_stores) if model is not None else {}
    violations.extend((f"items[{index}].adapters[{position}].name", not_a_lora(ref.name, kinds[ref.name]))
                      for index, item in enumerate(items) for position, ref in enumerate(item.adapters)
                      if ref.name in kinds and not same_kind(kinds[ref.name], common_pb2.ADAPTER_KIND_LORA))
    violations.extend(control_violations(
        items, model.pipeline if model is not None else None, kinds,
        capabilities.default_true_cfg if capabilities is not None else 0.0,
        guidance_is_true_cfg=capabilities is not None and capabilities.guidance == common_pb2.GUIDANCE_KIND_TRUE_CFG))
    images = sum(item.num_images for item in items)
    if not violations and first.task in VIDEO_TASKS and len(items) > 1:
        violations.append(("items", f"a video task runs one item per Execute, got {len(items)}"))
    if not violations and images > limits.max_batch_images:
        violations.append(("items", f"the batch has {images} images; this runner runs at most "
                                    f"{limits.max_batch_images}"))
    if violations:
        raise invalid_argument(violations)
    if model is not None:  # the image prompts' refusals for their kind come before any name not registered
        prompted = [(index, item.ip_adapter.name) for index, item in enumerate(items) if item.HasField("ip_adapter")]
        model.ip_adapters.check_batch(model.pipeline, prompted, kinds)
        check_registered(items, model.controlnets)


def video_capabilities(capabilities: Capabilities | None,
                       limits: BatchLimits) -> common_pb2.VideoCapabilities | None:
    """What a video model takes (None for an image model), its frames bounded by the runner's
    ``--max-frames`` too; with no model, any frame count within ``--max-frames``."""
    if capabilities is None:
        return common_pb2.VideoCapabilities(frame_step=1, min_frames=1, max_frames=limits.max_frames)
    video = capabilities.video
    if video is None:
        return None
    most = min(video.max_frames or limits.max_frames, limits.max_frames)
    return common_pb2.VideoCapabilities(
        frame_step=video.frame_step, min_frames=video.min_frames, max_frames=most,
        default_frames=min(video.default_frames, most), min_fps=video.min_fps, max_fps=video.max_fps,
        default_fps=video.default_fps)


def max_steps(capabilities: Capabilities, limits: BatchLimits) -> int:
    """The most steps a request may ask of the model here: what its schedulers run, within ``--max-steps``."""
    return min(capabilities.max_steps or limits.max_steps, limits.max_steps)


def model_summary(model: LoadedModel, limits: BatchLimits) -> common_pb2.ModelInfo:
    """What the loaded model takes here, as ModelInfo reports it (its pipeline, capabilities within the
    runner's limits, acceleration): the one mapping of the pipeline's capabilities onto the protocol,
    read back through ``ModelTerms.from_model_info`` by the runner's checks as by the worker's."""
    capabilities = model.capabilities
    return common_pb2.ModelInfo(
        pipeline_class=type(model.pipeline).__name__,
        capabilities=common_pb2.ModelCapabilities(
            video=video_capabilities(capabilities, limits),
            negative_prompt=capabilities.negative_prompt,
            guidance=capabilities.guidance,
            default_guidance_scale=capabilities.default_guidance,
            step_events=capabilities.step_events,
            step_callback=capabilities.step_callback,
            stages=capabilities.stages,
            tasks=[f"TASK_{task}" for task in capabilities.tasks],
            true_cfg=capabilities.true_cfg,
            default_true_cfg_scale=capabilities.default_true_cfg,
            max_steps=max_steps(capabilities, limits),
            samplers=capabilities.samplers,
            adapter_kinds=[*controlnet_kinds(model.pipeline), *adapter_kinds(model.pipeline)],
        ),
        acceleration=model.acceleration.to_proto(),
    )


def _item_violations(item: runner_pb2.ExecuteItem, params: GenerationParams, limits: BatchLimits, grid: SizeGrid,
                     summary: common_pb2.ModelInfo | None, terms: ModelTerms | None,
                     video: common_pb2.VideoCapabilities | None) -> list[tuple[str, str | None]]:
    """(field, why or None) for each rule an item (``params`` and its image inputs) is held to on the
    model (``summary``, its ModelInfo, and its ``terms``; None: no model)."""
    task = params.task
    one_video = task in VIDEO_TASKS and params.num_images > 1
    scale = params.true_cfg_scale
    checked: list[tuple[str, str | None]] = [
        ("request_id", request_id_problem(item.request_id, limits.max_request_id_chars)),
        ("width", grid.problem(params.width)),
        ("height", grid.problem(params.height)),
        ("num_inference_steps", steps_problem(params.num_inference_steps, limits.max_steps, terms)),
        ("sampler", sampler_problem(params.sampler, terms)),
        ("num_images", "a video task makes one video per item" if one_video
         else count_problem(params.num_images, limits.max_batch_images)),
        ("num_frames", num_frames_problem(task, params.num_frames, video)),
        ("partial_images", partial_images_problem(task, params.partial_images)),
        ("guidance_scale", guidance_problem(params.guidance_scale, limits.max_guidance)),
        ("true_cfg_scale", None if scale is None else true_cfg_problem(terms, scale, limits.max_guidance)),
        ("negative_prompt", negative_prompt_problem(terms, scale) if params.negative_prompt else None),
        ("strength", strength_problem(task, params.strength or None, params.num_inference_steps)),
        *GenerationParams.model_violations(GenerationParams.ruled_in(item), summary),
    ]
    for index, (name, adapter_scale) in enumerate(params.adapters):
        checked.append((f"adapters[{index}].name", adapter_name_problem(name)))
        checked.append((f"adapters[{index}].scale", adapter_scale_problem(adapter_scale, limits.max_adapter_scale)))
    checked.extend(image_prompt_violations(item))
    image, mask = item.HasField("image"), item.HasField("mask_image")
    checked.extend(task_violations(task, terms.tasks if terms is not None else None,
                                   terms.name if terms is not None else "", image, mask))
    needs = task_inputs(task)
    for name, channels, sent in (("image", 3, image and needs.image), ("mask_image", 1, mask and needs.mask)):
        raw = getattr(item, name)
        if sent and ((raw.width, raw.height, raw.channels) != (item.width, item.height, channels)
                     or len(raw.pixels) != item.width * item.height * channels):
            checked.append((name, f"must be {item.width}x{item.height}x{channels} bytes, got "
                                  f"{raw.width}x{raw.height}x{raw.channels} in {len(raw.pixels)}"))
    return checked


def task_name(item: runner_pb2.ExecuteItem) -> str:
    """The item's task as the pipeline adapter names it; unset is text-to-image."""
    return task_label(item.task or common_pb2.TASK_TEXT_TO_IMAGE).removeprefix("TASK_")


def image_inputs_of(items: list[runner_pb2.ExecuteItem]) -> ImageInputs | None:
    """The input images and masks, one per image generated (an item's shared by its images)."""
    needs = task_inputs(items[0].task)
    if not needs.image:
        return None
    images, masks = [], []
    for item in items:
        image = Image.frombytes("RGB", (item.width, item.height), item.image.pixels)
        images.extend([image] * item.num_images)
        if needs.mask:
            masks.extend([Image.frombytes("L", (item.width, item.height), item.mask_image.pixels)] * item.num_images)
    return ImageInputs(images, masks if needs.mask else None, items[0].strength if needs.strength else None)


def preview_targets(items: list[runner_pb2.ExecuteItem]) -> list[PreviewTarget]:
    """Every image of ``items``, in batch order, with the previews its item asks for."""
    return [PreviewTarget(item.request_id, index, item.partial_images)
            for item in items for index in range(item.num_images)]


def run_batch(
    model: LoadedModel,
    items: list[runner_pb2.ExecuteItem],
    on_step: StepCallback,
    cancelled: StopFlag,
    decode_budget: int = 0,
    spans: PhaseSpans | None = None,
    to_host: ToHost = plain_copy,
) -> list[ImageOutput] | list[VideoOutput]:
    """Denoises every image of every item in one pipeline call (a video task: the one video of its
    one item, decoded in tiles within ``decode_budget`` bytes, 0: diffusers' default tiles).

    Each image gets its own CPU generator seeded with the item's seed + its index, so an image
    depends only on its own seed and parameters, on every platform. ``cancelled`` is polled at
    every step boundary, and of a video also between the decoder's calls.

    ``spans`` gets the call's phases (``PhaseSpans``): text encoding, from the call's start to the
    pipeline's ``encode_prompt`` returning; denoising, from there to the last step's end; decoding, to
    the VAE's ``decode`` returning; the copy to host, from there to the uint8 pixels on the host
    (diffusers' postprocessing and the conversion to uint8 included). A pipeline without such a method
    or without step callbacks has that phase folded into the next one.

    The images (a video's frames) are converted to uint8 on the device and copied with ``to_host``
    (the platform's: through pinned memory on an accelerator), a quarter of float32's bytes; a
    pipeline asked for "np" (``PipelineAdapter.output_type``) made float32 on the host already.
    """
    prompts, negatives, generators, owners = [], [], [], []
    thresholds: list[float | None] = []
    for item in items:
        params = GenerationParams.from_item(item)
        for index in range(item.num_images):
            seed = image_seed(item.seed, index)
            thresholds.append(params.cache_threshold)
            prompts.append(item.prompt)
            negatives.append(item.negative_prompt)
            generators.append(torch.Generator("cpu").manual_seed(seed))
            owners.append((item.request_id, seed))
    first, call = items[0], GenerationParams.from_item(items[0])
    task = task_name(first)
    inputs = image_inputs_of(items)
    started = time.perf_counter()
    spans = spans or PhaseSpans()
    marks: dict[str, TimePoint] = {"start": spans.clock()}  # the last of each moment seen

    def mark(moment: str) -> Callable[[], None]:
        def seen() -> None:
            if moment != "encoded" or "stepped" not in marks:  # a later stage's prompts are not the encoding
                marks[moment] = spans.clock()
        return seen

    step_ends: list[float] = []  # when each denoising step ended: what an image costs (``model.costs``)
    targets = preview_targets(items)
    preview = model.preview if any(target.count for target in targets) else None
    taken: list[Preview] = []  # at the step being reported

    def latents_seen(done: int, total: int, latents: torch.Tensor) -> None:
        taken.extend(take_previews(preview, targets, latents, done, total))

    def progress(phase: int) -> Callable[[int, int], None]:
        def report(done: int, total: int) -> None:
            if phase != common_pb2.PROGRESS_PHASE_DECODING:
                step_ends.append(time.perf_counter())
                marks["stepped"] = spans.clock()
            if cancelled.is_set():
                logger.info("stopped after %s %d of %d: the call ended",
                            "decoder call" if phase == common_pb2.PROGRESS_PHASE_DECODING else "step", done, total)
                raise ExecutionCancelled
            on_step(StepProgress(done, total, (time.perf_counter() - started) * 1000, phase, tuple(taken)))
            taken.clear()

        return report

    if cancelled.is_set():
        raise ExecutionCancelled
    frames = first.num_frames if first.task in VIDEO_TASKS else 0
    decode: contextlib.AbstractContextManager[None] = contextlib.nullcontext()
    if frames:
        vae = model.pipeline.vae
        try:
            tiling = tiles_within(vae, decode_budget, frames, first.height, first.width)
        except DecodeOverBudget as error:
            raise ServiceError(grpc.StatusCode.RESOURCE_EXHAUSTED, str(error)) from None
        decode = decoding(vae, tiling, frames, first.height, first.width, progress(common_pb2.PROGRESS_PHASE_DECODING))
    pipeline = model.adapter.for_task(task)
    control_arguments: dict[str, Any] = {}
    control_noise: contextlib.AbstractContextManager[None] = contextlib.nullcontext()
    controlled = call_controls(model.controlnets, model.adapter, task, items)
    if controlled is not None:
        pipeline, control_arguments, control_noise = controlled.adapter, controlled.arguments, controlled.noise(
            model.device)
    model.adapters.activate(model.pipeline, list(call.adapters))
    model.ip_adapters.activate(model.pipeline, [call.ip_adapter.name] if call.ip_adapter is not None else [])
    image_prompts = [prompt_of(item) for item in items for _ in range(item.num_images)]
    cache = model.row_cache
    caching = (contextlib.nullcontext() if cache is None
               else cache.pipeline_call([cache.threshold_for(threshold) for threshold in thresholds],
                                        _denoiser_calls(call, inputs)))
    parallel: contextlib.AbstractContextManager[None] = contextlib.nullcontext()
    if model.parallel is not None:  # a runner group's: whether this call has two branches to split
        guided = model.parallel.guided(pipeline.scales(call.guidance_scale, call.true_cfg_scale))
        parallel = model.parallel.request(guided)
    observed = contextlib.ExitStack()
    observed.enter_context(returns_observed(pipeline.pipeline, "encode_prompt", mark("encoded")))
    observed.enter_context(returns_observed(getattr(pipeline.pipeline, "vae", None), "decode", mark("decoded")))
    observed.enter_context(control_noise)  # for the call alone (``ControlledCall.noise``)
    try:
        with torch.inference_mode(), caching, decode, parallel, observed, model.ip_adapters.pipeline_call(
                model.pipeline, image_prompts, call.guidance_scale, model.device) as conditioning:
            images = pipeline.generate(ImageRows(prompts, negatives, generators), call,
                                       progress(common_pb2.PROGRESS_PHASE_DENOISING), inputs,
                                       latents_seen if preview is not None else None,
                                       {**conditioning, **control_arguments})
    except OutputSizeMismatch as error:
        raise ServiceError(grpc.StatusCode.INTERNAL, str(error)) from None
    _measured(model, step_ends, started, len(prompts), first.width * first.height * max(frames, 1))
    pixels = to_host(as_pixels(images))
    _phases(spans, marks)
    if frames:
        return [VideoOutput(request_id, seed, video) for (request_id, seed), video in zip(owners, pixels, strict=True)]
    if inputs is not None and inputs.masks is not None:
        pixels = keep_unmasked(pixels, inputs)
    return [ImageOutput(request_id, seed, image) for (request_id, seed), image in zip(owners, pixels, strict=True)]


def _phases(spans: PhaseSpans, marks: dict[str, TimePoint]) -> None:
    """The call's phases from the moments seen (``run_batch``), the output now on the host; a phase
    whose end was not seen is left out and its time counts in the next one."""
    marks["host"] = spans.clock()
    start = marks["start"]
    for phase, end in ((TEXT_ENCODE, "encoded"), (DENOISE, "stepped"), (DECODE, "decoded"), (TO_HOST, "host")):
        if end in marks:
            spans.add(phase, start, marks[end])
            start = marks[end]


def _measured(model: LoadedModel, step_ends: list[float], started: float, images: int, pixels: int) -> None:
    """What one image of the call cost: its steps (the first also encoded the prompts, so it counts only
    alone) and its decode, from the step ends seen (a pipeline without step callbacks gives none)."""
    if not step_ends:
        return
    if len(step_ends) > 1:
        step_s = (step_ends[-1] - step_ends[0]) / (len(step_ends) - 1)
    else:
        step_s = step_ends[0] - started
    model.costs.observe(pixels, step_s * 1000 / images, (time.perf_counter() - step_ends[-1]) * 1000 / images)


def _denoiser_calls(call: GenerationParams, inputs: ImageInputs | None) -> int | None:
    """How many times a pipeline call calls its denoiser per row, for the step cache: its steps, but
    None (not known) where a strength below 1 runs fewer, by the pipeline's own rounding."""
    if inputs is not None and inputs.strength is not None and inputs.strength < 1:
        return None
    return call.num_inference_steps


def keep_unmasked(pixels: np.ndarray, inputs: ImageInputs) -> np.ndarray:
    """Inpainted images with the input's own pixels where the mask is black, blended where it is
    grey (diffusers' overlay, as A1111 does): the VAE's round trip never touches what was kept."""
    originals = np.stack([np.asarray(image) for image in inputs.images]).astype(np.float32)
    weights = np.stack([np.asarray(mask) for mask in inputs.masks or []]).astype(np.float32)[..., None] / 255
    blended = weights * pixels.astype(np.float32) + (1 - weights) * originals
    return np.round(blended).clip(0, 255).astype(np.uint8)


Outputs = list[ImageOutput] | list[VideoOutput]
# Runs a batch to its end on the device thread (the flag: the caller has gone, stop at the next
# step): its result (the outputs, the weights version they ran with, the phases' times).
BatchRun = Callable[[list[runner_pb2.ExecuteItem], StepCallback, Abandonment], BatchResult]


def run_checked(model: LoadedModel, items: list[runner_pb2.ExecuteItem], limits: BatchLimits, on_step: StepCallback,
                cancelled: StopFlag, clock: Clock | None = None, to_host: ToHost = plain_copy) -> BatchResult:
    """Checks the batch against ``limits`` and the model in place (its sizes; awake), then runs it,
    its phases timed with ``clock`` (the platform's ``time_point``; None: the host's clock), its
    images copied to the host with ``to_host`` (the platform's)."""
    validate_batch(items, limits, model)
    model.require_awake()
    started = time.perf_counter()
    spans = PhaseSpans() if clock is None else PhaseSpans(clock)
    outputs = run_batch(model, items, on_step, cancelled, limits.decode_budget_bytes, spans, to_host)
    return BatchResult(outputs, model.weights_version, (time.perf_counter() - started) * 1000, spans.resolve())


async def stream_batch(
    items: list[runner_pb2.ExecuteItem],
    run: BatchRun,
    pacing: ProgressPacing | None,
    thread: Executor | None = None,
) -> AsyncGenerator[StepProgress | BatchResult, None]:
    """Runs a batch in a thread: yields a ``StepProgress`` for each step ``pacing`` lets through
    (none when it is None), then one ``BatchResult``. The caller holds the device for as long as it iterates.

    ``run`` goes to ``thread`` (the runner's device thread; None: asyncio's default executor), so
    the batch runs on the model in place at that moment (``run_checked``). When the caller stops
    early (its call was cancelled), the thread is told to stop and the generator ends only once it
    has, at its next step boundary, so the caller's hold on the device outlasts it.
    """
    loop = asyncio.get_running_loop()
    events: asyncio.Queue[StepProgress | None] = asyncio.Queue()  # None: the thread is done
    cancelled = Abandonment()

    def on_step(event: StepProgress) -> None:
        if pacing is not None and pacing.due(event.step, event.total_steps, event.phase, bool(event.previews)):
            loop.call_soon_threadsafe(events.put_nowait, event)

    def execute() -> BatchResult:
        try:
            return run(items, on_step, cancelled)
        finally:
            loop.call_soon_threadsafe(events.put_nowait, None)

    started = time.perf_counter()
    work = asyncio.ensure_future(loop.run_in_executor(thread, execute))
    try:
        while (event := await events.get()) is not None:
            yield event
        result = await work
    finally:
        cancelled.set()
        await asyncio.wait({work})
        if not work.cancelled():
            work.exception()  # retrieved: a cancelled run ends in ExecutionCancelled
    yield dataclasses.replace(result, execute_ms=(time.perf_counter() - started) * 1000)
