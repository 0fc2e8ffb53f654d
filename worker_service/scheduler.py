"""The bounded queue and the dispatcher that runs batches of requests on the runners.

The dispatcher groups compatible queued requests (same width, height, steps and guidance) into
one runner Execute of at most ``max_batch_size`` images, waiting up to ``max_batch_delay`` after
the head of the queue arrived for the batch to fill. The head of the queue is always in the next
batch, so an incompatible request is never starved. Each ready runner runs one batch at a time;
a batch goes to an idle ready runner, the one that has run the fewest batches.

A batch whose runner becomes unreachable (it died) is retried once, on whichever runner is
ready next, for every request whose deadline leaves time for it; the others end UNAVAILABLE with
what happened. Generation is deterministic given the seed, so a retried image is the same.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from dataclasses import dataclass, field

import grpc

from diffusion.v1 import runner_pb2, worker_pb2

from .controller import ModelController
from .errors import RpcFailure
from .lifecycle import Lifecycle
from .runner_client import RunnerClient
from .validation import NormalizedRequest

logger = logging.getLogger(__name__)

MAX_ATTEMPTS = 2  # the first run and one retry
# Runner errors that mean "the runner went away", not "the request is bad".
RUNNER_LOST = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
DETACH_TIMEOUT_S = 60.0


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
    attempts: int = 0
    retried_after: str = ""  # what happened to the first attempt, when there was a retry
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

    @property
    def images(self) -> int:
        return self.request.num_images

    def batch_key(self) -> tuple[int, int, int, float]:
        r = self.request
        return (r.width, r.height, r.steps, r.guidance_scale)


@dataclass(eq=False)
class _Running:
    jobs: list[Job]
    runner: RunnerClient
    task: asyncio.Task[None] | None = None
    preempted: bool = False  # stopped by DetachRunner(drain=false): its jobs go back to the queue
    done: asyncio.Event = field(default_factory=asyncio.Event)


class Scheduler:
    """Admits jobs into a bounded FIFO, dispatches batches to the runners and cancels them on request."""

    def __init__(self, controller: ModelController, lifecycle: Lifecycle, max_queue: int, auto_wake: bool,
                 max_batch_size: int = 4, max_batch_delay_ms: float = 5.0,
                 max_runner_wait_s: float = 60.0) -> None:
        self._controller = controller
        self._lifecycle = lifecycle
        self._max_queue = max_queue
        self._auto_wake = auto_wake
        self.max_batch_size = max(1, max_batch_size)
        self.max_batch_delay = max(0.0, max_batch_delay_ms) / 1000
        # Queued requests without a deadline wait this long for some runner to be ready, then
        # end UNAVAILABLE: none waits forever for a runner that never comes back.
        self.max_runner_wait = max_runner_wait_s
        self._no_runner_since: float | None = None
        self._ms_per_step: dict[tuple[int, int, int, float], float] = {}  # last pace seen per batch shape
        self._queue: collections.deque[Job] = collections.deque()
        self._active: dict[str, Job] = {}
        self._running: dict[Job, _Running] = {}
        self._batches: set[_Running] = set()
        self._work = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        controller.on_change = self._work.set

    @property
    def active_ids(self) -> dict[str, Job]:
        return self._active

    @property
    def queue_depth(self) -> int:
        return len(self._queue)

    @property
    def in_flight(self) -> int:
        return len(self._running)

    def in_flight_on(self, runner: RunnerClient) -> int:
        return sum(len(b.jobs) for b in self._batches if b.runner is runner)

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
        running = self._running.get(job)
        if running is not None and running.task is not None and all(j.outcome for j in running.jobs):
            running.task.cancel()  # cancels the runner's Execute call: it stops at the next step
        # Otherwise the rest of the batch keeps going; this job's images are dropped.
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

    # -- the dispatcher --------------------------------------------------------------------

    def _expire(self, now: float) -> float | None:
        """Ends queued jobs whose deadline passed; returns seconds until the next deadline."""
        expired = [j for j in self._queue if j.deadline is not None and j.deadline <= now]
        for job in expired:
            self._queue.remove(job)
            waited = (now - job.admitted_at) * 1000
            why = f"; {job.retried_after}, and no runner could retry it in time" if job.retried_after else ""
            job.end(RpcFailure(grpc.StatusCode.DEADLINE_EXCEEDED,
                               f"deadline expired after {waited:.0f} ms in the queue{why}"))
        if expired:
            self._publish_positions()
        deadlines = [j.deadline for j in self._queue if j.deadline is not None]
        return max(min(deadlines) - now, 0.001) if deadlines else None

    def _pick_runner(self) -> RunnerClient | None:
        idle = [r for r in self._controller.runners if r.ready and r.running is None]
        return min(idle, key=lambda r: r.batches) if idle else None

    def _take_batch(self, now: float) -> tuple[list[Job], float | None]:
        """The next batch (head of the queue first, then compatible requests in order), or
        ([], seconds to wait) while it could still fill within the batch delay."""
        head = self._queue[0]
        key = head.batch_key()
        batch, images = [head], head.images
        for job in list(self._queue)[1:]:
            if images >= self.max_batch_size:
                break
            if job.batch_key() == key and images + job.images <= self.max_batch_size:
                batch.append(job)
                images += job.images
        fill_until = head.admitted_at + self.max_batch_delay
        if images < self.max_batch_size and now < fill_until and head.attempts == 0:
            return [], fill_until - now
        for job in batch:
            self._queue.remove(job)
        self._publish_positions()
        return batch, None

    def _fail_queue(self, failure: RpcFailure) -> None:
        while self._queue:
            self._queue.popleft().end(failure)

    async def _dispatch_some(self) -> float | None:
        """Starts every batch that can start now; returns seconds until it should look again."""
        now = time.monotonic()
        wake_in = self._expire(now)
        if not self._queue or self._controller.paused:
            return wake_in
        # Draining: what was admitted still runs (generation_blocker would refuse it as not ready).
        draining = self._lifecycle.draining
        blocker = None if draining else self._lifecycle.generation_blocker(self._auto_wake)
        if blocker is not None:
            if (blocker.code == grpc.StatusCode.UNAVAILABLE
                    or self._lifecycle.state == worker_pb2.WORKER_STATE_LOADING):
                # No runner ready yet (restarting, attaching): wait, within deadlines and a bound.
                since = self._no_runner_since = self._no_runner_since or now
                left = since + self.max_runner_wait - now
                if left <= 0:
                    self._fail_queue(RpcFailure(grpc.StatusCode.UNAVAILABLE,
                                                f"no runner was ready for {self.max_runner_wait:g} s "
                                                f"({self._lifecycle.message})"))
                    self._no_runner_since = None
                    return None
                return left if wake_in is None else min(left, wake_in)
            self._fail_queue(blocker)
            return None
        self._no_runner_since = None
        if self._lifecycle.sleeping_components and not draining:
            logger.info("waking the model for request %s (--auto-wake)", self._queue[0].request.request_id)
            try:
                await self._controller.wake_up([])
            except RpcFailure as failure:
                self._fail_queue(failure)
            return 0.0
        while self._queue:
            runner = self._pick_runner()
            if runner is None:
                break
            batch, wait = self._take_batch(now)
            if not batch:
                return wait if wake_in is None else min(wait, wake_in)
            self._start(runner, batch)
        return wake_in

    async def run(self) -> None:
        """The dispatcher: forever starts batches on idle ready runners."""
        while True:
            try:
                wake_in = await self._dispatch_some()
            except Exception:  # a bug must not stop every later request: log it and go on
                logger.exception("dispatcher error")
                wake_in = 0.1
            if wake_in is None:
                await self._work.wait()
            elif wake_in > 0:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._work.wait(), wake_in)
            self._work.clear()

    def _start(self, runner: RunnerClient, jobs: list[Job]) -> None:
        running = _Running(jobs, runner)
        runner.running = running
        runner.batches += 1
        self._batches.add(running)
        for job in jobs:
            self._running[job] = running
        self._controller.execution_started()
        images = sum(j.images for j in jobs)
        logger.info("batch of %d request(s) (%d image(s)) on runner %s: %s", len(jobs), images, runner.target,
                    " ".join(j.request.request_id for j in jobs))
        running.task = asyncio.create_task(self._execute(running), name=f"execute {jobs[0].request.request_id}")
        running.task.add_done_callback(lambda _: self._finished(running))

    def _finished(self, running: _Running) -> None:
        self._batches.discard(running)
        for job in running.jobs:
            if self._running.get(job) is running:
                del self._running[job]
        if running.runner.running is running:
            running.runner.running = None
        self._controller.execution_finished()
        running.done.set()
        self._work.set()

    async def _execute(self, running: _Running) -> None:
        batch, runner = running.jobs, running.runner
        now = time.monotonic()
        deadlines = [job.deadline for job in batch]
        timeout = None if None in deadlines else max(max(deadlines) - now, 0.001)  # type: ignore[type-var]
        request = build_execute_request([job.request for job in batch], progress=True)
        for job in batch:
            job.attempts += 1
            job.started_at = job.started_at or now
            job.emit(worker_pb2.GenerateStreamResponse(
                started=worker_pb2.StartedEvent(request_id=job.request.request_id)))
        by_id = {job.request.request_id: job for job in batch}
        step = total = 0
        elapsed_ms = 0.0
        try:
            async for response in runner.stub.Execute(request, timeout=timeout):
                if response.HasField("progress"):
                    progress = response.progress
                    step, total, elapsed_ms = progress.step, progress.total_steps, progress.elapsed_ms
                    self._ms_per_step[batch[0].batch_key()] = elapsed_ms / max(step, 1)
                    event = worker_pb2.GenerateStreamResponse(progress=worker_pb2.ProgressEvent(
                        step=progress.step, total_steps=progress.total_steps))
                    for request_id in progress.request_ids:
                        if request_id in by_id:
                            by_id[request_id].emit(event)
                elif response.HasField("result"):
                    result = response.result
                    await self._lifecycle.update(weights_version=result.weights_version)
                    # The runner's own time for the batch: the same for every request in it.
                    execute_ms = result.execute_ms or (time.monotonic() - now) * 1000
                    for output in result.outputs:
                        if output.request_id in by_id:
                            by_id[output.request_id].end(Finished(output, result.weights_version, execute_ms))
        except asyncio.CancelledError:
            if running.preempted:
                self._requeue([j for j in batch if j.outcome is None], counted=False)
            raise
        except grpc.aio.AioRpcError as error:
            if error.code() in RUNNER_LOST:
                self._runner_lost(running, error, step, total or batch[0].request.steps, elapsed_ms)
            else:
                failure = RpcFailure.from_rpc_error(error, runner.target)
                logger.warning("Execute failed for %s: %s %s", list(by_id), failure.code.name, failure.message)
                for job in batch:
                    job.end(failure)
        for job in batch:
            if job.outcome is None and job not in self._queue:
                job.end(RpcFailure(grpc.StatusCode.INTERNAL, "the runner returned no output for the request"))

    def _runner_lost(self, running: _Running, error: grpc.aio.AioRpcError, step: int, total: int,
                     elapsed_ms: float) -> None:
        """The runner went away mid-batch: retry once where the deadline allows, else UNAVAILABLE."""
        runner = running.runner
        runner.suspect = True  # no new work until the Watch or a probe says it is there
        asyncio.create_task(runner.probe(self._controller.on_runner_change))
        what = (f"runner {runner.target} failed after {step} of {total} steps "
                f"({error.code().name}: {error.details()})")
        # A retry repeats every step: estimated from this attempt's pace, or the last one seen
        # for this shape when the runner died before the first step (0 when never seen).
        pace = elapsed_ms / step if step else self._ms_per_step.get(running.jobs[0].batch_key(), 0.0)
        needed = pace * total / 1000
        now = time.monotonic()
        retry = []
        for job in running.jobs:
            if job.outcome is not None:
                continue
            if job.attempts >= MAX_ATTEMPTS:
                job.end(RpcFailure(grpc.StatusCode.UNAVAILABLE,
                                   f"{what}; not retried again: {job.retried_after} the first time"))
            elif job.deadline is not None and job.deadline - now <= needed:
                job.end(RpcFailure(grpc.StatusCode.UNAVAILABLE,
                                   f"{what}; not retried: {max(job.deadline - now, 0):.2f} s left before the "
                                   f"deadline, a retry needs about {needed:.2f} s"))
            else:
                job.retried_after = what
                retry.append(job)
        logger.warning("%s; retrying %d of %d request(s)", what, len(retry), len(running.jobs))
        self._requeue(retry, counted=True)

    def _requeue(self, jobs: list[Job], counted: bool) -> None:
        """Puts ``jobs`` back at the head of the queue, in order; their streams see queued again."""
        for job in reversed(jobs):
            if not counted:
                job.attempts -= 1
            job.position = -1
            self._queue.appendleft(job)
        if jobs:
            self._publish_positions()
            self._work.set()

    # -- attaching and detaching runners ---------------------------------------------------

    async def attach(self, target: str, timeout: float) -> RunnerClient:
        """Adds a runner; returns once it is ready (holds the desired state), or removes it and raises."""
        controller = self._controller
        if controller.find(target) is not None:
            raise RpcFailure(grpc.StatusCode.ALREADY_EXISTS, f"runner {target} is attached already")
        runner = RunnerClient(target)
        controller.runners.append(runner)
        runner.start(controller.on_runner_change)
        logger.info("attaching runner %s", target)
        deadline = time.monotonic() + timeout
        try:
            while not runner.ready:
                if runner.apply_error and runner.apply_task is not None and runner.apply_task.done():
                    raise RpcFailure(grpc.StatusCode.FAILED_PRECONDITION,
                                     f"runner {target} could not take the desired state: {runner.apply_error}")
                if time.monotonic() >= deadline:
                    raise RpcFailure(grpc.StatusCode.UNAVAILABLE if not runner.connected
                                     else grpc.StatusCode.DEADLINE_EXCEEDED,
                                     f"runner {target} was not ready within {timeout:.0f} s "
                                     f"({'not reachable' if not runner.connected else 'still loading'}); "
                                     "not attached")
                await asyncio.sleep(0.05)
        except BaseException:
            await self._remove(runner)
            raise
        logger.info("runner %s attached and ready", target)
        return runner

    async def detach(self, target: str, drain: bool) -> None:
        """Removes a runner: no new work from now; its running batch finishes (drain) or is re-queued."""
        runner = self._controller.find(target)
        if runner is None:
            raise RpcFailure(grpc.StatusCode.NOT_FOUND, f"runner {target} is not attached")
        runner.detaching = True
        logger.info("detaching runner %s (%s)", target, "drain" if drain else "re-queueing its work")
        running = runner.running
        if isinstance(running, _Running):
            if not drain and running.task is not None:
                running.preempted = True
                running.task.cancel()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(running.done.wait(), DETACH_TIMEOUT_S)
        await self._remove(runner)
        logger.info("runner %s detached", target)

    async def _remove(self, runner: RunnerClient) -> None:
        controller = self._controller
        async with controller.lock:  # not in the middle of an operation on it
            if runner in controller.runners:
                controller.runners.remove(runner)
        await runner.close()
        await controller.refresh()


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
