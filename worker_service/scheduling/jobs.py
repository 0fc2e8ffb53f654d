"""One admitted request and the events its call consumes."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Protocol

from diffusion.v1 import common_pb2, runner_pb2, worker_pb2
from serving_common.errors import ServiceError
from worker_service.validation import NormalizedRequest

BatchKey = tuple[object, ...]


@dataclass
class Finished:
    """The runner's output for one job; a video's frames (num_frames x height x width x 3 bytes per
    video, from the runner's ExecuteFrames) in ``frames``."""

    output: runner_pb2.ExecuteOutput
    weights_version: str
    execute_ms: float
    frames: list[bytearray] = field(default_factory=list)
    runner_timings: common_pb2.RunnerTimings = field(default_factory=common_pb2.RunnerTimings)
    # The Execute call's time on the worker less the runner's execute_ms: the request's trip to the
    # runner, its wait there for the device, the result's (and a video's frames') trip back.
    transfer_ms: float = 0.0


# The phases whose steps are denoising steps (unset: a runner from before video).
DENOISING = (common_pb2.PROGRESS_PHASE_UNSPECIFIED, common_pb2.PROGRESS_PHASE_DENOISING)

Event = worker_pb2.GenerateStreamResponse | Finished | ServiceError


class Cancellable(Protocol):
    """The batch a job runs in, as cancellation sees it."""

    def cancel_if_abandoned(self) -> None:
        """Stops the batch when none of its jobs still waits for it."""


@dataclass(eq=False)
class Job:
    """One admitted request; its call reads ``events``, which end with Finished or a ServiceError."""

    request: NormalizedRequest
    deadline: float | None  # time.monotonic() at which the client gives up
    stream: bool = False  # only streaming calls get queued, started and progress events
    admitted_at: float = field(default_factory=time.monotonic)
    started_at: float | None = None
    position: int = -1
    step: int = 0  # of the attempt running now, as the last progress event said
    attempts: int = 0
    retried_after: str = ""  # what happened to the first attempt, when there was a retry
    outcome: Finished | ServiceError | None = None
    batch: Cancellable | None = None  # the batch running it, while one does
    events: asyncio.Queue[Event] = field(default_factory=asyncio.Queue)

    def emit(self, event: worker_pb2.GenerateStreamResponse) -> None:
        if event.HasField("progress") and event.progress.phase in DENOISING:
            self.step = event.progress.step
        if self.stream and self.outcome is None:
            self.events.put_nowait(event)

    def end(self, outcome: Finished | ServiceError) -> None:
        """Sets the final outcome; the first one wins."""
        if self.outcome is None:
            self.outcome = outcome
            self.events.put_nowait(outcome)

    @property
    def images(self) -> int:
        return self.request.num_images

    @property
    def video(self) -> bool:
        """A video request: it runs alone in its Execute, on a runner running nothing else."""
        return self.request.video

    @property
    def frames(self) -> int:
        """The frames each of its outputs has: a video's, or 1 for an image."""
        return self.request.num_frames or 1

    def batch_key(self) -> BatchKey:
        """Requests with the same key can share one runner Execute (videos never do: ``select_batch``)."""
        return self.request.batch_key()

    @property
    def input_bytes(self) -> int:
        """The bytes of its input images (image, mask, control and reference images) in a runner Execute."""
        return sum(len(raw.pixels) for raw in self.request.raw_inputs)
