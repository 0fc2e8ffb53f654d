"""Runs one batch of generation requests through the pipeline's denoising loop.

``run_batch`` is the blocking denoising call; ``stream_batch`` runs it in a thread for the
asyncio server, holding the device lock, and streams its progress.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncGenerator, Callable
from concurrent.futures import Executor
from dataclasses import dataclass

import grpc
import numpy as np
import torch
from PIL import Image

from diffusion.v1 import common_pb2, runner_pb2
from runner_service.limits import BatchLimits
from runner_service.loaded_model import LoadedModel
from runner_service.pipeline_adapter import Capabilities, ImageInputs, OutputSizeMismatch
from serving_common.errors import ServiceError, invalid_argument
from serving_common.input_rules import adapter_name_problem, text_problem
from serving_common.protocol import image_seed

logger = logging.getLogger(__name__)

SHARED_FIELDS = ("width", "height", "num_inference_steps", "guidance_scale", "task", "strength")
# The tasks that take an image, and those of them that take a strength and a mask.
IMAGE_TASKS = frozenset({"IMAGE_TO_IMAGE", "INPAINT", "EDIT"})
STRENGTH_TASKS = frozenset({"IMAGE_TO_IMAGE", "INPAINT"})
# Beyond this, classifier-free guidance only saturates the image (3e38 gave an all-black one).
MAX_GUIDANCE = 100.0
# An adapter's per-request scale multiplies its update: 1e30 overflows it (the worker allows 10).
MAX_ADAPTER_SCALE = 100.0
# Request ids name the requests in the runner's log.
MAX_REQUEST_ID_CHARS = 256

StepCallback = Callable[[int, int, float], None]


class ExecutionCancelled(Exception):
    """Raised from the step callback to stop denoising at a step boundary."""


@dataclass(frozen=True)
class ImageOutput:
    request_id: str
    seed: int
    pixels: np.ndarray  # height x width x 3, uint8


@dataclass(frozen=True)
class StepProgress:
    step: int  # 1-based
    total_steps: int
    elapsed_ms: float


@dataclass(frozen=True)
class BatchResult:
    outputs: list[ImageOutput]
    weights_version: str  # of the weights the batch ran with
    execute_ms: float


def validate_batch(items: list[runner_pb2.ExecuteItem], limits: BatchLimits,
                   model: LoadedModel | None = None) -> None:
    """Checks the runner's bounds and, given the model, the image sizes it can generate."""
    if not items:
        raise invalid_argument({"items": "a batch needs at least one item"})
    capabilities = model.capabilities if model is not None else None
    # The model's grid as it reports it (no model: only the bounds; the run fails for want of one).
    multiple = capabilities.size_multiple if capabilities is not None else 1
    smallest = max(capabilities.min_size if capabilities is not None else 0, multiple)
    largest = min(limits.max_size, capabilities.max_size or limits.max_size) if capabilities else limits.max_size
    violations = {}
    first = items[0]
    for index, item in enumerate(items):
        for name in ("width", "height"):
            value = getattr(item, name)
            if value % multiple or not smallest <= value <= largest:
                violations[f"items[{index}].{name}"] = (
                    f"{value} is not a multiple of {multiple} from {smallest} to {largest}")
        if capabilities is not None:
            violations.update(_guidance_violations(item, f"items[{index}]", capabilities))
        if not 1 <= item.num_inference_steps <= limits.max_steps:
            violations[f"items[{index}].num_inference_steps"] = f"must be 1 to {limits.max_steps}"
        if not 1 <= item.num_images <= limits.max_batch_images:
            violations[f"items[{index}].num_images"] = f"must be 1 to {limits.max_batch_images}"
        if not np.isfinite(item.guidance_scale) or not 0 <= item.guidance_scale <= MAX_GUIDANCE:
            violations[f"items[{index}].guidance_scale"] = f"must be finite, from 0 to {MAX_GUIDANCE:g}"
        violations.update(_name_violations(item, f"items[{index}]"))
        for name in SHARED_FIELDS:
            if getattr(item, name) != getattr(first, name):
                violations[f"items[{index}].{name}"] = f"differs from items[0]; a batch shares {SHARED_FIELDS}"
        if true_cfg(item) != true_cfg(first):
            violations[f"items[{index}].true_cfg_scale"] = "differs from items[0]; a batch shares it"
        if adapter_scales(item) != adapter_scales(first):
            violations[f"items[{index}].adapters"] = "differs from items[0]; a batch shares its adapters"
        violations.update(_image_violations(item, f"items[{index}]", capabilities.tasks if capabilities else None))
    images = sum(item.num_images for item in items)
    if not violations and images > limits.max_batch_images:
        violations["items"] = f"the batch has {images} images; this runner runs at most {limits.max_batch_images}"
    if violations:
        raise invalid_argument(violations)


def _name_violations(item: runner_pb2.ExecuteItem, where: str) -> dict[str, str]:
    """The request id fits a log line; each adapter has a name it could be loaded by and a finite scale
    within ``MAX_ADAPTER_SCALE``."""
    violations = {}
    problem = text_problem(item.request_id, MAX_REQUEST_ID_CHARS)
    if problem is not None:
        violations[f"{where}.request_id"] = problem
    for index, (name, scale) in enumerate(adapter_scales(item)):
        problem = adapter_name_problem(name)
        if problem is not None:
            violations[f"{where}.adapters[{index}].name"] = problem
        if not np.isfinite(scale) or abs(scale) > MAX_ADAPTER_SCALE:
            violations[f"{where}.adapters[{index}].scale"] = (f"must be finite, from -{MAX_ADAPTER_SCALE:g} to "
                                                              f"{MAX_ADAPTER_SCALE:g}")
    return violations


def _guidance_violations(item: runner_pb2.ExecuteItem, where: str, capabilities: Capabilities) -> dict[str, str]:
    """A true_cfg_scale only where it is the pipeline's own argument, in the guidance bounds; a
    negative prompt only where the model uses it (with true CFG: a scale above 1)."""
    violations = {}
    scale = true_cfg(item)
    if scale is not None:
        if not capabilities.separate_true_cfg:
            violations[f"{where}.true_cfg_scale"] = ("this model's true CFG scale is guidance_scale"
                                                     if capabilities.true_cfg else "this model takes no true_cfg_scale")
        elif not np.isfinite(scale) or not 0 <= scale <= MAX_GUIDANCE:
            violations[f"{where}.true_cfg_scale"] = f"must be finite, from 0 to {MAX_GUIDANCE:g}"
    if item.negative_prompt:
        if not capabilities.negative_prompt:
            violations[f"{where}.negative_prompt"] = "this model takes no negative prompt"
        elif capabilities.separate_true_cfg and (capabilities.default_true_cfg if scale is None else scale) <= 1:
            violations[f"{where}.negative_prompt"] = "used only with a true_cfg_scale above 1"
    return violations


def true_cfg(item: runner_pb2.ExecuteItem) -> float | None:
    """The item's true_cfg_scale; None when unset (the pipeline's default)."""
    return item.true_cfg_scale if item.HasField("true_cfg_scale") else None


def task_name(item: runner_pb2.ExecuteItem) -> str:
    """The item's task as the pipeline adapter names it; unset is text-to-image."""
    task = item.task or common_pb2.TASK_TEXT_TO_IMAGE
    return common_pb2.Task.Name(task).removeprefix("TASK_") if task in common_pb2.Task.values() else str(task)


def _image_violations(item: runner_pb2.ExecuteItem, where: str, tasks: tuple[str, ...] | None) -> dict[str, str]:
    """The task is one the model serves; the image, mask and strength are those it needs."""
    task = task_name(item)
    violations = {}
    if tasks is not None and task not in tasks:
        violations[f"{where}.task"] = f"this model serves {', '.join(tasks)}, not {task}"
    inputs = {"image": (task in IMAGE_TASKS, 3), "mask_image": (task == "INPAINT", 1)}
    for name, (needed, channels) in inputs.items():
        given = item.HasField(name)
        raw = getattr(item, name)
        if given != needed:
            violations[f"{where}.{name}"] = f"{task} {'needs' if needed else 'takes no'} {name}"
        elif given and ((raw.width, raw.height, raw.channels) != (item.width, item.height, channels)
                        or len(raw.pixels) != item.width * item.height * channels):
            violations[f"{where}.{name}"] = (f"must be {item.width}x{item.height}x{channels} bytes, got "
                                             f"{raw.width}x{raw.height}x{raw.channels} in {len(raw.pixels)}")
    if task in STRENGTH_TASKS:
        if not 0 < item.strength <= 1:
            violations[f"{where}.strength"] = f"must be in (0, 1], got {item.strength:g}"
        elif int(item.num_inference_steps * item.strength) < 1:
            violations[f"{where}.strength"] = (f"{item.strength:g} of {item.num_inference_steps} steps runs none; "
                                               "at least one is needed")
    elif item.strength:
        violations[f"{where}.strength"] = f"{task} takes no strength"
    return violations


def _image_inputs(items: list[runner_pb2.ExecuteItem], task: str) -> ImageInputs | None:
    """The input images and masks, one per image generated (an item's shared by its images)."""
    if task not in IMAGE_TASKS:
        return None
    images, masks = [], []
    for item in items:
        image = Image.frombytes("RGB", (item.width, item.height), item.image.pixels)
        images.extend([image] * item.num_images)
        if task == "INPAINT":
            masks.extend([Image.frombytes("L", (item.width, item.height), item.mask_image.pixels)] * item.num_images)
    return ImageInputs(images, masks if task == "INPAINT" else None,
                       items[0].strength if task in STRENGTH_TASKS else None)


def adapter_scales(item: runner_pb2.ExecuteItem) -> list[tuple[str, float]]:
    """An item's adapters as (name, scale) pairs; an unset scale is 1."""
    return [(ref.name, ref.scale if ref.HasField("scale") else 1.0) for ref in item.adapters]


def run_batch(
    model: LoadedModel,
    items: list[runner_pb2.ExecuteItem],
    on_step: StepCallback,
    cancelled: threading.Event,
) -> list[ImageOutput]:
    """Denoises every image of every item in one pipeline call.

    Each image gets its own CPU generator seeded with the item's seed + its index, so an image
    depends only on its own seed and parameters, on every platform. ``cancelled`` is polled at
    every step boundary.
    """
    prompts, negatives, generators, owners = [], [], [], []
    for item in items:
        for index in range(item.num_images):
            seed = image_seed(item.seed, index)
            prompts.append(item.prompt)
            negatives.append(item.negative_prompt)
            generators.append(torch.Generator("cpu").manual_seed(seed))
            owners.append((item.request_id, seed))
    first = items[0]
    task = task_name(first)
    inputs = _image_inputs(items, task)
    started = time.perf_counter()

    def step(done: int, total: int) -> None:
        if cancelled.is_set():
            logger.info("stopped after step %d of %d: the call ended", done, total)
            raise ExecutionCancelled
        on_step(done, total, (time.perf_counter() - started) * 1000)

    if cancelled.is_set():
        raise ExecutionCancelled
    pipeline = model.adapter.for_task(task)
    model.adapters.activate(model.pipeline, adapter_scales(first))
    try:
        with torch.inference_mode():
            images = pipeline.generate(prompts, negatives, generators, first.width, first.height,
                                       first.num_inference_steps, first.guidance_scale, step, inputs,
                                       true_cfg(first))
    except OutputSizeMismatch as error:
        raise ServiceError(grpc.StatusCode.INTERNAL, str(error)) from None
    pixels = (images * 255).round().clip(0, 255).astype(np.uint8)
    if inputs is not None and inputs.masks is not None:
        pixels = _keep_unmasked(pixels, inputs)
    return [ImageOutput(request_id, seed, image) for (request_id, seed), image in zip(owners, pixels, strict=True)]


def _keep_unmasked(pixels: np.ndarray, inputs: ImageInputs) -> np.ndarray:
    """Inpainted images with the input's own pixels where the mask is black, blended where it is
    grey (diffusers' overlay, as A1111 does): the VAE's round trip never touches what was kept."""
    originals = np.stack([np.asarray(image) for image in inputs.images]).astype(np.float32)
    weights = np.stack([np.asarray(mask) for mask in inputs.masks or []]).astype(np.float32)[..., None] / 255
    blended = weights * pixels.astype(np.float32) + (1 - weights) * originals
    return blended.round().clip(0, 255).astype(np.uint8)


async def stream_batch(
    items: list[runner_pb2.ExecuteItem],
    device: asyncio.Lock,
    current_model: Callable[[], LoadedModel],
    progress: bool,
    limits: BatchLimits | None = None,
    thread: Executor | None = None,
) -> AsyncGenerator[StepProgress | BatchResult, None]:
    """Runs a batch in a thread while holding ``device``: yields a ``StepProgress`` per step (when
    ``progress``), then one ``BatchResult``.

    The run goes to ``thread`` (the runner's device thread; None: asyncio's default executor).
    ``current_model`` is called under the lock, so the batch runs on the model in place at that
    moment, and is checked there against ``limits`` and that model's sizes. When the caller
    stops early (its call was cancelled), the thread is told to stop and the lock is released
    only once it has, at its next step boundary.
    """
    loop = asyncio.get_running_loop()
    events: asyncio.Queue[StepProgress | None] = asyncio.Queue()  # None: the thread is done
    cancelled = threading.Event()

    def on_step(step: int, total: int, elapsed_ms: float) -> None:
        if progress:
            loop.call_soon_threadsafe(events.put_nowait, StepProgress(step, total, elapsed_ms))

    def execute() -> tuple[list[ImageOutput], str]:
        try:
            model = current_model()
            validate_batch(items, limits or BatchLimits(), model)
            model.require_awake()
            return run_batch(model, items, on_step, cancelled), model.weights_version
        finally:
            loop.call_soon_threadsafe(events.put_nowait, None)

    async with device:
        started = time.perf_counter()
        work = asyncio.ensure_future(loop.run_in_executor(thread, execute))
        try:
            while (event := await events.get()) is not None:
                yield event
            outputs, weights_version = await work
        finally:
            cancelled.set()
            await asyncio.wait({work})
            if not work.cancelled():
                work.exception()  # retrieved: a cancelled run ends in ExecutionCancelled
    yield BatchResult(outputs, weights_version, (time.perf_counter() - started) * 1000)
