"""The bounded FIFO of admitted requests: admission, queue positions, deadlines and cancellation,
and the budget of image input bytes held by requests in progress (``--max-input-bytes``)."""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Iterable
from dataclasses import dataclass

import grpc

from diffusion.v1 import worker_pb2
from serving_common.errors import ServiceError, unavailable
from worker_service.config import DEFAULT_MAX_INPUT_BYTES
from worker_service.lifecycle import Lifecycle
from worker_service.scheduling.jobs import Job

# Seconds a caller refused for a full queue is told to wait (RetryInfo) before trying again.
QUEUE_FULL_RETRY_S = 1.0


@dataclass
class Admission:
    """A request with image inputs, let in before they are decoded: it holds a queue place until it
    is queued (so that requests still decoding count against ``--max-queue``) and its input bytes
    until its call ends, when ``AdmissionQueue.leave`` frees both."""

    input_bytes: int
    holds_place: bool = True


class AdmissionQueue:
    """Admits jobs while the worker can serve them and the queue has room; owns the queue and the
    set of active (queued, running or encoding) requests. ``wakeup`` is set whenever the
    dispatcher has something new to look at.

    Image inputs are bounded in bytes, ``max_input_bytes`` in all: a request's encoded image and
    mask stay in memory (in its gRPC message) for as long as its call runs, so they count from
    admission to the call's end."""

    def __init__(self, lifecycle: Lifecycle, max_queue: int, auto_wake: bool, wakeup: asyncio.Event,
                 max_input_bytes: int = DEFAULT_MAX_INPUT_BYTES) -> None:
        self._lifecycle = lifecycle
        self._max_queue = max_queue
        self._max_input_bytes = max_input_bytes
        self._places = 0  # admitted requests still decoding their inputs
        self._input_bytes = 0  # image input bytes of admitted requests whose calls have not ended
        self.auto_wake = auto_wake
        self._wakeup = wakeup
        self._queue: collections.deque[Job] = collections.deque()
        self._active: dict[str, Job] = {}
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def active(self) -> dict[str, Job]:
        """Every admitted request whose call has not ended, by request id."""
        return self._active

    @property
    def jobs(self) -> list[Job]:
        """The queued jobs, head first."""
        return list(self._queue)

    def __len__(self) -> int:
        return len(self._queue)

    def admit(self, input_bytes: int) -> Admission:
        """Lets in a request with ``input_bytes`` of image inputs, before anything is decoded, or
        raises ServiceError: draining, not ready, the queue is full (counting requests still
        decoding) or the inputs do not fit in what ``--max-input-bytes`` has left. The caller must
        ``leave`` when its call ends, however it ends."""
        self.check_open()
        self._check_room()
        if input_bytes > self._max_input_bytes - self._input_bytes:
            raise self._inputs_refused(input_bytes)
        self._places += 1
        self._input_bytes += input_bytes
        return Admission(input_bytes)

    def leave(self, admission: Admission) -> None:
        """Frees what ``admission`` holds: its queue place if it was never queued, its input bytes."""
        if admission.holds_place:
            admission.holds_place = False
            self._places -= 1
        self._input_bytes -= admission.input_bytes
        admission.input_bytes = 0

    def _inputs_refused(self, input_bytes: int) -> ServiceError:
        limit = f"--max-input-bytes ({self._max_input_bytes})"
        if input_bytes > self._max_input_bytes:
            return ServiceError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"image inputs of {input_bytes} bytes are more than {limit}")
        return ServiceError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                            f"image inputs of {input_bytes} bytes do not fit: requests in progress hold "
                            f"{self._input_bytes} of {limit}; retry in a few seconds or on another worker")

    def submit(self, job: Job, admission: Admission | None = None) -> None:
        """Queues ``job`` or raises ServiceError: draining, not ready, or the queue is full (unless
        ``admission`` holds a place for it)."""
        self.check_open()
        if admission is not None and admission.holds_place:
            admission.holds_place = False
            self._places -= 1
        else:
            self._check_room()
        self._active[job.request.request_id] = job
        self._idle.clear()
        self._queue.append(job)
        self._publish_positions()
        self._wakeup.set()

    def check_open(self) -> None:
        """Raises ServiceError where no request may be served now: draining, or not ready (what a
        result cache hit, answered without queueing, is held to as well)."""
        if self._lifecycle.draining:
            raise unavailable("worker is draining")
        blocker = self._lifecycle.generation_blocker(self.auto_wake)
        if blocker is not None:
            raise blocker

    def _check_room(self) -> None:
        if len(self._queue) + self._places >= self._max_queue:
            raise ServiceError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                               f"queue is full ({self._max_queue} requests waiting); retry in a few seconds "
                               "or on another worker", retry_after=QUEUE_FULL_RETRY_S)

    def cancel(self, request_id: str, failure: ServiceError) -> str | None:
        """Ends an active job with ``failure``; returns where it was ("queued"/"running") or None."""
        job = self._active.get(request_id)
        if job is None or job.outcome is not None:
            return None
        return self._cancel(job, failure)

    def _cancel(self, job: Job, failure: ServiceError) -> str:
        job.end(failure)
        if job in self._queue:
            self._queue.remove(job)
            self._publish_positions()
            return "queued"
        if job.batch is not None:
            job.batch.cancel_if_abandoned()  # the rest of the batch may keep going; this job's images are dropped
        return "running"

    def release(self, job: Job) -> None:
        """Called when the job's call ends, however it ends; cancels the job if it is still pending."""
        if job.outcome is None:
            self._cancel(job, ServiceError(grpc.StatusCode.CANCELLED, "the client cancelled the call"))
        if self._active.get(job.request.request_id) is job:
            del self._active[job.request.request_id]
        if not self._active:
            self._idle.set()

    def cancel_all(self, failure: ServiceError) -> None:
        for job in list(self._active.values()):
            if job.outcome is None:
                self._cancel(job, failure)

    async def wait_idle(self) -> None:
        await self._idle.wait()

    # -- used by the dispatcher --------------------------------------------------------------

    def expire(self, now: float) -> float | None:
        """Ends queued jobs whose deadline passed; returns seconds until the next deadline."""
        expired = [j for j in self._queue if j.deadline is not None and j.deadline <= now]
        for job in expired:
            self._queue.remove(job)
            waited = (now - job.admitted_at) * 1000
            why = f"; {job.retried_after}, and no runner could retry it in time" if job.retried_after else ""
            job.end(ServiceError(grpc.StatusCode.DEADLINE_EXCEEDED,
                                 f"deadline expired after {waited:.0f} ms in the queue{why}"))
        if expired:
            self._publish_positions()
        deadlines = [j.deadline for j in self._queue if j.deadline is not None]
        return max(min(deadlines) - now, 0.001) if deadlines else None

    def take(self, jobs: Iterable[Job]) -> None:
        """Removes ``jobs`` (a batch about to start) from the queue."""
        for job in jobs:
            self._queue.remove(job)
        self._publish_positions()

    def requeue(self, jobs: list[Job]) -> None:
        """Puts ``jobs`` back at the head of the queue, in order; their streams see queued again."""
        for job in reversed(jobs):
            job.position = -1
            self._queue.appendleft(job)
        if jobs:
            self._publish_positions()
            self._wakeup.set()

    def fail_all(self, failure: ServiceError) -> None:
        """Ends every queued job with ``failure``."""
        while self._queue:
            self._queue.popleft().end(failure)

    def _publish_positions(self) -> None:
        for position, job in enumerate(self._queue):
            if job.position != position:
                job.position = position
                job.emit(worker_pb2.GenerateStreamResponse(
                    queued=worker_pb2.QueuedEvent(request_id=job.request.request_id, position=position)))
