"""The bounded queue and the dispatcher that runs requests on the runner, one batch at a time.

A batch is a list of jobs; today each holds one job, and ``_take_batch`` is the seam where
compatible requests (same size, steps and guidance) can later be grouped into one Execute.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from dataclasses import dataclass, field

import grpc

from diffusion.v1 import runner_pb2, worker_pb2

from .controller import ModelController
from .errors import RpcFailure
from .lifecycle import Lifecycle
from .validation import NormalizedRequest

logger = logging.getLogger(__name__)


@dataclass
class Finished:
    """The runner's output for one job."""

    output: runner_pb2.ExecuteOutput
    weights_version: str
    execute_ms: float


Event = worker_pb2.GenerateStreamResponse | Finished | RpcFailure


@dataclass(eq=False)
class Job:
    """One admitted request and the events its call consumes, in order, ending with Finished or a failure."""

    request: NormalizedRequest
    deadline: float | None  # time.monotonic() at which the client gives up
    stream: bool = False  # only streaming calls get queued, started and progress events
    admitted_at: float = field(default_factory=time.monotonic)
    started_at: float | None = None
    position: int = -1
    outcome: Finished | RpcFailure | None = None
    events: asyncio.Queue[Event] = field(default_factory=asyncio.Queue)

    def emit(self, event: worker_pb2.GenerateStreamResponse) -> None:
        if self.stream and self.outcome is None:
            self.events.put_nowait(event)

    def end(self, outcome: Finished | RpcFailure) -> None:
        """Sets the final outcome; the first one wins."""
        if self.outcome is None:
            self.outcome = outcome
            self.events.put_nowait(outcome)


@dataclass
class _Running:
    jobs: list[Job]
    task: asyncio.Task[None]


class Scheduler:
    """Admits jobs into a bounded FIFO, dispatches them to the runner and cancels them on request."""

    def __init__(self, controller: ModelController, lifecycle: Lifecycle, max_queue: int, auto_wake: bool) -> None:
        self._controller = controller
        self._lifecycle = lifecycle
        self._max_queue = max_queue
        self._auto_wake = auto_wake
        self._queue: collections.deque[Job] = collections.deque()
        self._active: dict[str, Job] = {}
        self._running: _Running | None = None
        self._work = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def active_ids(self) -> dict[str, Job]:
        return self._active

    @property
    def queue_depth(self) -> int:
        return len(self._queue)

    @property
    def in_flight(self) -> int:
        return len(self._running.jobs) if self._running else 0

    def submit(self, job: Job) -> None:
        """Queues ``job`` or raises RpcFailure: draining, not ready, or the queue is full."""
        if self._lifecycle.draining:
            raise RpcFailure(grpc.StatusCode.UNAVAILABLE, "worker is draining")
        blocker = self._lifecycle.generation_blocker(self._auto_wake)
        if blocker is not None:
            raise blocker
        if len(self._queue) >= self._max_queue:
            raise RpcFailure(grpc.StatusCode.RESOURCE_EXHAUSTED,
                             f"queue is full ({self._max_queue} requests waiting); retry in a few seconds "
                             "or on another worker")
        self._active[job.request.request_id] = job
        self._idle.clear()
        self._queue.append(job)
        self._publish_positions()
        self._work.set()

    def cancel(self, request_id: str, failure: RpcFailure) -> str | None:
        """Ends an active job with ``failure``; returns where it was ("queued"/"running") or None."""
        job = self._active.get(request_id)
        if job is None or job.outcome is not None:
            return None
        return self._cancel(job, failure)

    def _cancel(self, job: Job, failure: RpcFailure) -> str:
        job.end(failure)
        if job in self._queue:
            self._queue.remove(job)
            self._publish_positions()
            return "queued"
        running = self._running
        if running is not None and job in running.jobs and all(j.outcome for j in running.jobs):
            running.task.cancel()  # cancels the runner's Execute call: it stops at the next step
        return "running"

    def release(self, job: Job) -> None:
        """Called when the job's call ends, however it ends; cancels the job if it is still pending."""
        if job.outcome is None:
            self._cancel(job, RpcFailure(grpc.StatusCode.CANCELLED, "the client cancelled the call"))
        if self._active.get(job.request.request_id) is job:
            del self._active[job.request.request_id]
        if not self._active:
            self._idle.set()

    def cancel_all(self, failure: RpcFailure) -> None:
        for job in list(self._active.values()):
            if job.outcome is None:
                self._cancel(job, failure)

    async def wait_idle(self) -> None:
        await self._idle.wait()

    def _publish_positions(self) -> None:
        for position, job in enumerate(self._queue):
            if job.position != position:
                job.position = position
                job.emit(worker_pb2.GenerateStreamResponse(
                    queued=worker_pb2.QueuedEvent(request_id=job.request.request_id, position=position)))

    def _take_batch(self) -> list[Job]:
        """The next batch: today the first job whose deadline has not passed."""
        now = time.monotonic()
        while self._queue:
            job = self._queue.popleft()
            if job.deadline is not None and job.deadline <= now:
                waited = (now - job.admitted_at) * 1000
                job.end(RpcFailure(grpc.StatusCode.DEADLINE_EXCEEDED,
                                   f"deadline expired after {waited:.0f} ms in the queue"))
                continue
            self._publish_positions()
            return [job]
        return []

    async def run(self) -> None:
        """The dispatcher: forever takes the next batch and runs it while holding the runner lock."""
        while True:
            await self._work.wait()
            async with self._controller.lock:
                batch = self._take_batch()
                if not self._queue:
                    self._work.clear()
                if batch:
                    await self._dispatch(batch)

    async def _dispatch(self, batch: list[Job]) -> None:
        try:
            blocker = self._lifecycle.generation_blocker(self._auto_wake)
            if blocker is not None:
                raise blocker
            if self._lifecycle.sleeping_components:
                logger.info("waking the model for request %s (--auto-wake)", batch[0].request.request_id)
                await self._controller.wake_up_locked([])
        except RpcFailure as failure:
            for job in batch:
                job.end(failure)
            return
        batch = [job for job in batch if job.outcome is None]  # cancelled during an auto-wake
        if not batch:
            return
        task = asyncio.create_task(self._execute(batch))
        self._running = _Running(batch, task)
        try:
            await asyncio.wait([task])
        finally:
            self._running = None
            if not task.done():
                task.cancel()

    async def _execute(self, batch: list[Job]) -> None:
        runner = self._controller.runner
        now = time.monotonic()
        deadlines = [job.deadline for job in batch if job.deadline is not None]
        timeout = max(min(deadlines) - now, 0.001) if deadlines else None
        wants_progress = any(job.stream for job in batch)
        request = build_execute_request([job.request for job in batch], progress=wants_progress)
        for job in batch:
            job.started_at = now
            job.emit(worker_pb2.GenerateStreamResponse(
                started=worker_pb2.StartedEvent(request_id=job.request.request_id)))
        by_id = {job.request.request_id: job for job in batch}
        try:
            async for response in runner.stub.Execute(request, timeout=timeout):
                if response.HasField("progress"):
                    event = worker_pb2.GenerateStreamResponse(progress=worker_pb2.ProgressEvent(
                        step=response.progress.step, total_steps=response.progress.total_steps))
                    for job in batch:
                        job.emit(event)
                elif response.HasField("result"):
                    result = response.result
                    await self._lifecycle.update(weights_version=result.weights_version)
                    for output in result.outputs:
                        if output.request_id in by_id:
                            by_id[output.request_id].end(
                                Finished(output, result.weights_version, (time.monotonic() - now) * 1000))
        except grpc.aio.AioRpcError as error:
            failure = RpcFailure.from_rpc_error(error, runner.target)
            logger.warning("Execute failed for %s: %s %s", list(by_id), failure.code.name, failure.message)
            for job in batch:
                job.end(failure)
        for job in batch:
            job.end(RpcFailure(grpc.StatusCode.INTERNAL, "the runner returned no output for the request"))


def build_execute_request(requests: list[NormalizedRequest], progress: bool) -> runner_pb2.ExecuteRequest:
    """One runner Execute for compatible requests (same width, height, steps and guidance)."""
    return runner_pb2.ExecuteRequest(
        progress=progress,
        items=[
            runner_pb2.ExecuteItem(
                request_id=r.request_id, prompt=r.prompt, negative_prompt=r.negative_prompt,
                width=r.width, height=r.height, num_inference_steps=r.steps,
                guidance_scale=r.guidance_scale, seed=r.seed, num_images=r.num_images)
            for r in requests
        ],
    )
