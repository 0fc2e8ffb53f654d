"""A per-row step cache's images in a step batch against each image alone: what the tests of every
cache (``test_row_cache``, ``test_taylorseer_cache``, ``test_unet_cache``) run the same way, in
process, and what the served ones (``test_acceleration_served``, ``test_taylorseer_served``) send."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from diffusion.v1 import worker_pb2, worker_pb2_grpc
from harness.streams import Stream
from runner_service.acceleration.step_cache import StepCache
from runner_service.denoising.loop import DenoisingLoop, Sequence, SequenceSpec
from runner_service.denoising.prompt_cache import PromptCache
from support import pixels as response_pixels

# What a loop's decode of one sequence becomes: its image's pixels, H x W x C uint8.
Pixels = Callable[[Any], np.ndarray]


def denoised_alone(loop: DenoisingLoop, cache: StepCache | None, spec: SequenceSpec, pixels: Pixels) -> np.ndarray:
    """``spec``'s image, its sequence stepped alone with ``cache``."""
    sequence = loop.start(spec, PromptCache(0), "")
    while not sequence.finished:
        loop.step([sequence], cache)
    return pixels(loop.decode([sequence]))


def denoised_joining(loop: DenoisingLoop, cache: StepCache, first: SequenceSpec,
                     joining: dict[int, SequenceSpec], pixels: Pixels) -> dict[int, np.ndarray]:
    """Each image by its seed: ``first`` starts alone, each of ``joining`` joins the running batch
    before the step its key counts (from 0), and a sequence leaves as it finishes."""
    running: list[Sequence] = [loop.start(first, PromptCache(0), "")]
    finished: dict[int, np.ndarray] = {}
    step = 0
    while running:
        if step in joining:
            running.append(loop.start(joining[step], PromptCache(0), ""))
        loop.step(running, cache)
        step += 1
        for sequence in [s for s in running if s.finished]:
            finished[sequence.spec.seed] = pixels(loop.decode([sequence]))
            running.remove(sequence)
    return finished


def served_joining(stub: worker_pb2_grpc.WorkerServiceStub, first: worker_pb2.GenerateRequest,
                   joining: list[worker_pb2.GenerateRequest], at_step: int = 3) -> list[np.ndarray]:
    """The images of ``first`` and of each of ``joining``, streamed from a worker: ``joining`` is
    sent once ``first`` has run ``at_step`` steps, so its requests join ``first``'s step batch."""
    started = Stream(stub, first)
    started.wait_step(at_step)
    streams = [started, *(Stream(stub, request) for request in joining)]
    images = []
    for stream in streams:
        stream.finish(120)
        assert stream.done is not None, stream.error
        images.append(response_pixels(stream.done))
    return images
