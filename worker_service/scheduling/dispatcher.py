"""The dispatcher: runs batches of queued requests on idle ready runners, and retries once.

Each round it plans what to send where (``plan.plan_dispatch``, a pure function of the queue and
the runners' states: in order, or by compute when the runners take turns by compute), then starts
the plan's Executes. A ready runner runs one batch at a time, or, when its model batches at steps,
any number of Executes of one request each up to the batch size in images, which join its running
batch at the next step. What runs on a runner is its handle's to keep (``RunnerHandle.running``):
the dispatcher keeps no record of its own.

A batch whose runner becomes unreachable (it died) or shows no progress
for the stall timeout (it hangs; or twice a step and a decode as long as the runner measured them,
when longer) is retried once, on whichever runner is ready next, for every request whose deadline
leaves time for it; the others end UNAVAILABLE with what happened. A runner that showed no progress
gets no work until the work it was stuck in has ended (``RunnerHandle.stalled``).
Generation is deterministic given the seed, so a retried image is the same.

A video runs alone on a runner running nothing else (like a full batch): its frames come in
ExecuteFrames before the result, into one buffer per video allocated at its first frames with the
size its request says (``VideoFrames``); a runner that sends anything else ends the request INTERNAL.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field

import grpc

from diffusion.v1 import runner_pb2, worker_pb2
from serving_common.errors import ServiceError, unavailable
from worker_service.controller import ModelController
from worker_service.lifecycle import Lifecycle
from worker_service.runners import RunnerHandle, RunnerPool
from worker_service.runners.gate import ExecutionGate
from worker_service.runners.handle import CallOutcome
from worker_service.scheduling.admission import AdmissionQueue
from worker_service.scheduling.batching import BatchPolicy, retry_seconds
from worker_service.scheduling.budget import DeficitRoundRobin
from worker_service.scheduling.estimate import pause_seconds
from worker_service.scheduling.jobs import DENOISING, BatchKey, Finished, Job
from worker_service.scheduling.plan import DispatchPlan, RunnerView, plan_dispatch
from worker_service.scheduling.previews import encoded_previews
from worker_service.validation import NormalizedRequest

logger = logging.getLogger(__name__)

MAX_ATTEMPTS = 2  # the first run and one retry
DISPATCHER_ERROR_PAUSE_S = 0.1
STALL_STEPS = 10  # a step this many times slower than the last one seen for the shape is a stall
# The runner's progress for a batch no client streams is read only as a heartbeat: at most one
# message this often (or a quarter of --runner-stall-timeout, where that is shorter), not one a
# step (ExecuteRequest.progress_interval_ms).
HEARTBEAT_PROGRESS_MS = 100


class VideoFrames:
    """The frames of one video as the runner sends them, into a buffer of exactly the size the
    request says (num_frames x height x width x 3): frames outside it or of another size are refused."""

    def __init__(self, request: NormalizedRequest) -> None:
        self._frame_bytes = request.width * request.height * 3
        self._num_frames = request.num_frames
        self.buffer = bytearray(request.frame_bytes)
        self._filled = [False] * request.num_frames

    def add(self, message: runner_pb2.ExecuteFrames) -> str | None:
        """Copies the message's frames in; returns what is wrong with it instead, if anything."""
        count, extra = divmod(len(message.pixels), self._frame_bytes)
        if extra or not count or message.first_frame + count > self._num_frames:
            return (f"the runner sent {len(message.pixels)} bytes of frames at frame {message.first_frame} of a "
                    f"{self._num_frames}-frame video of {self._frame_bytes} bytes a frame")
        start = message.first_frame * self._frame_bytes
        self.buffer[start:start + len(message.pixels)] = message.pixels
        self._filled[message.first_frame:message.first_frame + count] = [True] * count
        return None

    def missing(self, video: runner_pb2.RawVideo | None, request: NormalizedRequest) -> str | None:
        """What is wrong with the result's video, given the frames received; None when it is whole."""
        if video is None or (video.width, video.height, video.num_frames) != (
                request.width, request.height, request.num_frames):
            return (f"the runner's result has no {request.width}x{request.height} video of {request.num_frames} "
                    "frames")
        if not all(self._filled):
            return f"the runner sent {sum(self._filled)} of the video's {self._num_frames} frames"
        return None


@dataclass(eq=False)
class _Batch:
    """One runner Execute as it runs; its runner's handle keeps it while it does."""

    jobs: list[Job]
    runner: RunnerHandle
    full: int  # the images of a full batch: what a video takes of its runner
    task: asyncio.Task[None] | None = None
    # Its runner Execute, once started.
    call: grpc.aio.UnaryStreamCall[runner_pb2.ExecuteRequest, runner_pb2.ExecuteResponse] | None = None
    preempted: bool = False  # stopped by DetachRunner(drain=false): its jobs go back to the queue
    done: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def images(self) -> int:
        """Its images, as the runner's room counts them: a video fills it."""
        return self.full if any(job.video for job in self.jobs) else sum(job.images for job in self.jobs)

    def preempt(self) -> None:
        if self.task is not None:
            self.preempted = True
            self.task.cancel()

    async def wait(self, timeout: float) -> None:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                await self.done.wait()

    def cancel_if_abandoned(self) -> None:
        if self.task is not None and all(j.outcome is not None for j in self.jobs):
            # The call is cancelled here, not only through the task's end: the runner stops at its next
            # step however the task's cancel falls against the response it is reading.
            if self.call is not None:
                self.call.cancel()
            self.task.cancel()


class Dispatcher:
    def __init__(self, queue: AdmissionQueue, pool: RunnerPool, gate: ExecutionGate, controller: ModelController,
                 lifecycle: Lifecycle, wakeup: asyncio.Event, policy: BatchPolicy, max_runner_wait_s: float = 60.0,
                 stall_timeout_s: float = 60.0) -> None:
        self._queue = queue
        self._pool = pool
        self._gate = gate
        self._controller = controller
        self._lifecycle = lifecycle
        self._wakeup = wakeup
        self.policy = policy
        self._turns = DeficitRoundRobin()  # the size classes' turns, while the runners take turns by compute
        self._by_budget = False  # how the last round scheduled: by compute, or in order
        # Queued requests without a deadline wait this long for some runner to be ready, then
        # end UNAVAILABLE: none waits forever for a runner that never comes back.
        self.max_runner_wait = max_runner_wait_s
        self.stall_timeout = stall_timeout_s
        # A heartbeat well inside the stall timeout, so that pacing never reads as a stall.
        self._heartbeat_ms = min(HEARTBEAT_PROGRESS_MS, int(stall_timeout_s * 1000 / 4))
        self._no_runner_since: float | None = None
        self._ms_per_step: dict[BatchKey, float] = {}  # last pace seen per batch shape

    @property
    def in_flight(self) -> int:
        """Requests running on a runner now, as the runners' handles keep them."""
        return sum(runner.in_flight for runner in self._pool.runners)

    async def run(self) -> None:
        """Forever: starts batches on idle ready runners."""
        while True:
            try:
                wake_in = await self._dispatch_some()
            except Exception:  # a bug must not stop every later request: log it and go on
                logger.exception("dispatcher error")
                wake_in = DISPATCHER_ERROR_PAUSE_S
            if wake_in is None:
                await self._wakeup.wait()
            elif wake_in > 0:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(wake_in):
                        await self._wakeup.wait()
            self._wakeup.clear()

    async def _dispatch_some(self) -> float | None:
        """Starts every batch that can start now; returns seconds until it should look again."""
        now = time.monotonic()
        wake_in = self._queue.expire(now)
        if not len(self._queue) or self._gate.paused:
            return wake_in
        # Draining: what was admitted still runs (generation_blocker would refuse it as not ready).
        draining = self._lifecycle.draining
        blocker = None if draining else self._lifecycle.generation_blocker(self._queue.auto_wake)
        if blocker is not None:
            if (blocker.code == grpc.StatusCode.UNAVAILABLE
                    or self._lifecycle.state == worker_pb2.WORKER_STATE_LOADING):
                return _earliest(self._wait_for_runner(now), wake_in)
            self._queue.fail_all(blocker)
            return None
        self._no_runner_since = None
        if self._lifecycle.sleeping_components and not draining:
            logger.info("waking the model for request %s (--auto-wake)", self._queue.jobs[0].request.request_id)
            try:
                await self._controller.wake_up([])
            except ServiceError as failure:
                self._queue.fail_all(failure)
            return 0.0
        runners = {runner.target: runner for runner in self._pool.runners}
        plan = plan_dispatch(self._queue.jobs, [RunnerView.of(runner, self.policy.max_batch_size)
                                                for runner in runners.values()], self.policy, now, self._turns)
        self._apply(plan, runners)
        return _earliest(plan.wait, wake_in)

    def _apply(self, plan: DispatchPlan, runners: dict[str, RunnerHandle]) -> None:
        """Starts the plan's Executes and keeps its turns; the first Execute sent after the way of
        scheduling changed logs it."""
        self._turns = plan.turns
        if plan.batches and plan.by_budget != self._by_budget:
            self._by_budget = plan.by_budget
            if plan.by_budget:
                logger.info("scheduling by compute: every ready runner takes turns (--step-schedule budget)")
            else:
                logger.info("scheduling in order: runner(s) %s do not take turns by compute", ", ".join(
                    runner.target for runner in runners.values() if runner.ready and not runner.takes_turns))
        for scheduled in plan.batches:
            self._queue.take(scheduled.jobs)
            self._start(runners[scheduled.target], list(scheduled.jobs))

    def _wait_for_runner(self, now: float) -> float | None:
        """No runner ready yet (restarting, attaching): wait, within deadlines and a bound."""
        since = self._no_runner_since = self._no_runner_since or now
        left = since + self.max_runner_wait - now
        if left > 0:
            return left
        self._queue.fail_all(unavailable(f"no runner was ready for {self.max_runner_wait:g} s "
                                         f"({self._lifecycle.message})"))
        self._no_runner_since = None
        return None

    def _start(self, runner: RunnerHandle, jobs: list[Job]) -> None:
        batch = _Batch(jobs, runner, self.policy.max_batch_size)
        runner.batch_started(batch)
        for job in jobs:
            job.batch = batch
        self._gate.execution_started()
        logger.info("batch of %d request(s) (%d image(s)) on runner %s: %s", len(jobs),
                    sum(j.images for j in jobs), runner.target, " ".join(j.request.request_id for j in jobs))
        batch.task = asyncio.create_task(self._execute(batch), name=f"execute {jobs[0].request.request_id}")
        batch.task.add_done_callback(lambda _: self._finished(batch))

    def _finished(self, batch: _Batch) -> None:
        for job in batch.jobs:
            if job.batch is batch:
                job.batch = None
        batch.runner.batch_ended(batch)
        self._gate.execution_finished()
        batch.done.set()
        self._wakeup.set()

    async def _execute(self, batch: _Batch) -> None:
        jobs, runner = batch.jobs, batch.runner
        now = time.monotonic()
        deadlines = [job.deadline for job in jobs]
        timeout = None if None in deadlines else max(max(d for d in deadlines if d is not None) - now, 0.001)
        # Progress is a heartbeat (stall detection, GetStatus) unless a client streams it.
        request = build_execute_request([job.request for job in jobs],
                                        0 if any(job.stream for job in jobs) else self._heartbeat_ms)
        for job in jobs:
            job.attempts += 1
            job.started_at = job.started_at or now
            job.emit(worker_pb2.GenerateStreamResponse(
                started=worker_pb2.StartedEvent(request_id=job.request.request_id)))
        by_id = {job.request.request_id: job for job in jobs}
        videos: dict[str, VideoFrames] = {}  # this attempt's frames, by request id
        key = jobs[0].batch_key()
        step, total = 0, jobs[0].request.num_inference_steps
        elapsed_ms = 0.0
        # A step and a decode as long as the runner measured them are no stall, however long.
        measured_pause = 2 * pause_seconds([job.request for job in jobs], runner.info.model if runner.info else None)
        call = batch.call = runner.stub.Execute(request, timeout=timeout)
        responses = call.__aiter__()
        try:
            while True:
                stall_after = max(self.stall_timeout, STALL_STEPS * self._ms_per_step.get(key, 0.0) / 1000,
                                  measured_pause)
                try:
                    # asyncio.timeout, not wait_for: Python 3.11's wait_for swallows a cancel that falls as a
                    # response arrives, and the dropped batch would then run to its end.
                    async with asyncio.timeout(stall_after):
                        response = await responses.__anext__()
                except StopAsyncIteration:
                    break
                except TimeoutError:
                    call.cancel()
                    runner.stalled()  # out of readiness until the work it is stuck in has ended
                    self._runner_lost(batch, f"runner {runner.target} showed no progress for {stall_after:.0f} s "
                                      f"after {step} of {total} steps (hung?)", step, total, elapsed_ms)
                    return
                if response.HasField("progress"):
                    progress = response.progress
                    if progress.phase in DENOISING:  # decoding's steps are not denoising's
                        step, total, elapsed_ms = progress.step, progress.total_steps, progress.elapsed_ms
                        self._ms_per_step[key] = elapsed_ms / max(step, 1)
                    previews = await encoded_previews(progress, {
                        request_id: job.request for request_id, job in by_id.items() if job.outcome is None})
                    for request_id in progress.request_ids:
                        if request_id in by_id:
                            taken = previews.get(request_id)
                            by_id[request_id].emit(worker_pb2.GenerateStreamResponse(progress=worker_pb2.ProgressEvent(
                                step=progress.step, total_steps=progress.total_steps, phase=progress.phase,
                                previews=taken.images if taken else (),
                                partial_image_index=taken.partial_image_index if taken else 0)))
                elif response.HasField("frames"):
                    _add_frames(response.frames, by_id, videos)
                elif response.HasField("result"):
                    result = response.result
                    # The runner's own time for the batch: the same for every request in it.
                    call_ms = (time.monotonic() - now) * 1000
                    execute_ms = result.execute_ms or call_ms
                    for output in result.outputs:
                        if output.request_id in by_id:
                            _finish(by_id[output.request_id], output, videos,
                                    Finished(output, result.weights_version, execute_ms,
                                             runner_timings=result.timings,
                                             transfer_ms=max(0.0, call_ms - execute_ms)))
        except asyncio.CancelledError:
            if batch.preempted:
                self._requeue([j for j in jobs if j.outcome is None], counted=False)
            raise
        except grpc.aio.AioRpcError as error:
            if runner.on_call_outcome(error.code()) is CallOutcome.LOST:
                self._runner_lost(batch, f"runner {runner.target} failed after {step} of {total} steps "
                                  f"({error.code().name}: {error.details()})", step, total, elapsed_ms)
            else:
                failure = ServiceError.from_rpc_error(error, runner.target)
                logger.warning("Execute failed for %s: %s %s", list(by_id), failure.code.name, failure.message)
                for job in jobs:
                    job.end(failure)
        finally:
            # Ended before its first read (cancelled: all its requests were), the call itself would go
            # on until garbage collected, and the runner with it; after its end this does nothing.
            call.cancel()
        for job in jobs:
            if job.outcome is None and job not in self._queue.jobs:
                job.end(ServiceError(grpc.StatusCode.INTERNAL, "the runner returned no output for the request"))

    def _runner_lost(self, batch: _Batch, what: str, step: int, total: int, elapsed_ms: float) -> None:
        """The runner went away or hangs mid-batch (its handle is suspect): retry once where the
        deadline allows, else UNAVAILABLE."""
        needed = retry_seconds(elapsed_ms, step, total, self._ms_per_step.get(batch.jobs[0].batch_key(), 0.0))
        now = time.monotonic()
        retry = []
        for job in batch.jobs:
            if job.outcome is not None:
                continue
            if job.attempts >= MAX_ATTEMPTS:
                job.end(unavailable(f"{what}; not retried again: {job.retried_after} the first time"))
            elif job.deadline is not None and job.deadline - now <= needed:
                job.end(unavailable(f"{what}; not retried: {max(job.deadline - now, 0):.2f} s left before the "
                                    f"deadline, a retry needs about {needed:.2f} s"))
            else:
                job.retried_after = what
                retry.append(job)
        logger.warning("%s; retrying %d of %d request(s)", what, len(retry), len(batch.jobs))
        self._requeue(retry, counted=True)

    def _requeue(self, jobs: list[Job], counted: bool) -> None:
        """Back to the head of the queue; an attempt cut short by a detach does not count."""
        if not counted:
            for job in jobs:
                job.attempts -= 1
        self._queue.requeue(jobs)


def _add_frames(message: runner_pb2.ExecuteFrames, by_id: dict[str, Job], videos: dict[str, VideoFrames]) -> None:
    """Frames of a video into its buffer (allocated at its first frames); a message out of its bounds
    ends the request INTERNAL. Frames of a request no longer in the batch are dropped."""
    job = by_id.get(message.request_id)
    if job is None or job.outcome is not None:
        return
    problem = (f"the runner sent frames of video {message.video_index} of a request of one video"
               if message.video_index or not job.video else None)
    if problem is None:
        frames = videos.get(job.request.request_id)
        if frames is None:
            frames = videos[job.request.request_id] = VideoFrames(job.request)
        problem = frames.add(message)
    if problem is not None:
        logger.error("request %s: %s", job.request.request_id, problem)
        videos.pop(job.request.request_id, None)
        job.end(ServiceError(grpc.StatusCode.INTERNAL, problem))


def _finish(job: Job, output: runner_pb2.ExecuteOutput, videos: dict[str, VideoFrames], finished: Finished) -> None:
    """Ends ``job`` with its output, a video's with its frames once they are all there (else INTERNAL)."""
    if not job.video:
        job.end(finished)
        return
    frames = videos.pop(job.request.request_id, None)
    if frames is None:
        problem = "the runner sent no frames of the video"
    else:
        missing = frames.missing(output.videos[0] if len(output.videos) == 1 else None, job.request)
        if missing is None:
            finished.frames.append(frames.buffer)
            job.end(finished)
            return
        problem = missing
    logger.error("request %s: %s", job.request.request_id, problem)
    job.end(ServiceError(grpc.StatusCode.INTERNAL, problem))


def _earliest(a: float | None, b: float | None) -> float | None:
    return a if b is None else b if a is None else min(a, b)


def build_execute_request(requests: list[NormalizedRequest], progress_interval_ms: int) -> runner_pb2.ExecuteRequest:
    """One runner Execute for requests of one batch key (``GenerationParams.batch_key``), with its
    progress paced to ``progress_interval_ms`` (0: every step)."""
    return runner_pb2.ExecuteRequest(
        progress=True, progress_interval_ms=progress_interval_ms, items=[r.item() for r in requests])
