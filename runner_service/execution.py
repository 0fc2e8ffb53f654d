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
from dataclasses import dataclass

import grpc
import numpy as np
import torch

from diffusion.v1 import runner_pb2
from runner_service.loaded_model import LoadedModel
from runner_service.pipeline_adapter import OutputSizeMismatch
from serving_common.errors import ServiceError, invalid_argument
from serving_common.protocol import image_seed

logger = logging.getLogger(__name__)

SHARED_FIELDS = ("width", "height", "num_inference_steps", "guidance_scale")
# Beyond this, classifier-free guidance only saturates the image (3e38 gave an all-black one).
MAX_GUIDANCE = 100.0
# Without a model's own grid (an unknown pipeline), sizes are multiples of the usual VAE factor.
DEFAULT_SIZE_MULTIPLE = 8

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


@dataclass(frozen=True)
class BatchLimits:
    """The runner's own bounds on a batch (``--max-batch-images``, ``--max-size``, ``--max-steps``):
    the worker applies tighter ones, these hold whoever calls."""

    max_batch_images: int = 16
    max_size: int = 2048
    max_steps: int = 1000


def validate_batch(items: list[runner_pb2.ExecuteItem], limits: BatchLimits,
                   model: LoadedModel | None = None) -> None:
    """Checks the runner's bounds and, given the model, the image sizes it can generate."""
    if not items:
        raise invalid_argument({"items": "a batch needs at least one item"})
    capabilities = model.capabilities if model is not None else None
    multiple = capabilities.size_multiple if capabilities is not None and capabilities.size_multiple \
        else DEFAULT_SIZE_MULTIPLE
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
        if item.negative_prompt and capabilities is not None and not capabilities.negative_prompt:
            violations[f"items[{index}].negative_prompt"] = "this model takes no negative prompt"
        if not 1 <= item.num_inference_steps <= limits.max_steps:
            violations[f"items[{index}].num_inference_steps"] = f"must be 1 to {limits.max_steps}"
        if not 1 <= item.num_images <= limits.max_batch_images:
            violations[f"items[{index}].num_images"] = f"must be 1 to {limits.max_batch_images}"
        if not np.isfinite(item.guidance_scale) or not 0 <= item.guidance_scale <= MAX_GUIDANCE:
            violations[f"items[{index}].guidance_scale"] = f"must be finite, from 0 to {MAX_GUIDANCE:g}"
        for name in SHARED_FIELDS:
            if getattr(item, name) != getattr(first, name):
                violations[f"items[{index}].{name}"] = f"differs from items[0]; a batch shares {SHARED_FIELDS}"
        if adapter_scales(item) != adapter_scales(first):
            violations[f"items[{index}].adapters"] = "differs from items[0]; a batch shares its adapters"
    images = sum(item.num_images for item in items)
    if not violations and images > limits.max_batch_images:
        violations["items"] = f"the batch has {images} images; this runner runs at most {limits.max_batch_images}"
    if violations:
        raise invalid_argument(violations)


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
    total = model.capabilities.total_steps(first.num_inference_steps)
    started = time.perf_counter()

    def step(done: int) -> None:
        if cancelled.is_set():
            logger.info("stopped after step %d of %d: the call ended", done, total)
            raise ExecutionCancelled
        on_step(done, total, (time.perf_counter() - started) * 1000)

    if cancelled.is_set():
        raise ExecutionCancelled
    model.adapters.activate(model.pipeline, adapter_scales(first))
    try:
        with torch.inference_mode():
            images = model.adapter.generate(prompts, negatives, generators, first.width, first.height,
                                            first.num_inference_steps, first.guidance_scale, step)
    except OutputSizeMismatch as error:
        raise ServiceError(grpc.StatusCode.INTERNAL, str(error)) from None
    pixels = (images * 255).round().clip(0, 255).astype(np.uint8)
    return [ImageOutput(request_id, seed, image) for (request_id, seed), image in zip(owners, pixels, strict=True)]


async def stream_batch(
    items: list[runner_pb2.ExecuteItem],
    device: asyncio.Lock,
    current_model: Callable[[], LoadedModel],
    progress: bool,
    limits: BatchLimits | None = None,
) -> AsyncGenerator[StepProgress | BatchResult, None]:
    """Runs a batch in a thread while holding ``device``: yields a ``StepProgress`` per step (when
    ``progress``), then one ``BatchResult``.

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
        work = asyncio.ensure_future(asyncio.to_thread(execute))
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
