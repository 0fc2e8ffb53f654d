"""The jobs of the OpenAI Videos API (``POST /v1/videos``), kept in the worker's memory.

A video takes minutes, so OpenAI's API answers a create at once with a job that the caller polls
(``GET /v1/videos/{id}``) and downloads when it is completed. Every job and every finished video
lives in this process, so each is bounded (``--max-video-jobs``, ``--max-video-bytes``,
``--video-job-ttl-s``):

- a job past ``max_jobs`` (queued, running and completed ones count) is refused
  RESOURCE_EXHAUSTED before anything runs. A failed job holds no video and frees its place: it
  stays readable until it expires, but a burst of failures cannot block creates for the TTL; at
  most ``max_jobs`` failed ones are kept besides, the oldest dropped first;
- a finished video is kept only when it fits the bytes left of ``max_bytes``: one that does not
  fails its job with RESOURCE_EXHAUSTED, and its bytes are dropped, so the store never grows past it;
- a finished job (completed or failed) is dropped ``ttl_s`` after it ended (``expires_at``), when
  the store is next used: it is then unknown (NOT_FOUND) and its bytes are free;
- deleting a queued or running job cancels its task, whose cancellation ends the request on the
  worker, and waits for that task to end, so nothing of it runs after the delete is answered.

Progress maps the worker's progress events onto OpenAI's 0..100 (``PHASE_SPANS``): denoising
steps 0 to 80, the VAE's decoder calls 80 to 95, encoding the frames 95 to 99; 100 once the video
is kept. The clock (unix seconds) is a dependency, so that expiry is tested without waiting.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

from diffusion.v1 import common_pb2, worker_pb2
from serving_common.errors import ServiceError

# ProgressPhase -> the part of 0..100 its steps fill. Unset is denoising, as for peers before video.
DENOISING = (0, 80)
PHASE_SPANS = {common_pb2.PROGRESS_PHASE_UNSPECIFIED: DENOISING, common_pb2.PROGRESS_PHASE_DENOISING: DENOISING,
               common_pb2.PROGRESS_PHASE_DECODING: (80, 95), common_pb2.PROGRESS_PHASE_ENCODING: (95, 99)}
QUEUED, IN_PROGRESS, COMPLETED, FAILED = "queued", "in_progress", "completed", "failed"


@dataclass(frozen=True)
class JobError:
    """Why a job failed, as OpenAI's ``VideoCreateError`` says it (``code``: the gRPC status name in
    lower case, as the HTTP errors' ``code``; ``param``: the field at fault, if one is)."""

    code: str
    message: str
    param: str | None = None


@dataclass(eq=False)
class VideoJob:
    """One video job: what was asked (``size``, ``seconds``, as the job object reports them) and where
    it stands."""

    id: str
    model: str
    prompt: str
    size: str  # WIDTHxHEIGHT
    seconds: str  # num_frames / fps
    num_frames: int
    fps: int
    created_at: int
    status: str = QUEUED
    progress: int = 0
    completed_at: int | None = None
    expires_at: int | None = None
    error: JobError | None = None
    content: bytes = b""  # the MP4, once completed
    task: asyncio.Task[None] | None = field(default=None, repr=False)

    @property
    def finished(self) -> bool:
        return self.status in (COMPLETED, FAILED)

    def on_progress(self, event: worker_pb2.ProgressEvent) -> None:
        """A progress event of its request: the job is in progress, and never goes backwards."""
        if self.finished:
            return
        low, high = PHASE_SPANS.get(event.phase, DENOISING)
        done = min(event.step, event.total_steps) / event.total_steps if event.total_steps else 0.0
        self.status = IN_PROGRESS
        self.progress = max(self.progress, low + int((high - low) * done))

    def as_json(self) -> dict[str, object]:
        """OpenAI's ``Video`` object; ``num_frames`` and ``fps`` are vLLM-Omni's extensions."""
        error = None if self.error is None else {"code": self.error.code, "message": self.error.message,
                                                  "param": self.error.param}
        return {"id": self.id, "object": "video", "status": self.status, "progress": self.progress,
                "created_at": self.created_at, "completed_at": self.completed_at, "expires_at": self.expires_at,
                "model": self.model, "prompt": self.prompt, "seconds": self.seconds, "size": self.size,
                "error": error, "remixed_from_video_id": None, "num_frames": self.num_frames, "fps": self.fps}


class VideoJobStore:
    """At most ``max_jobs`` jobs and ``max_bytes`` of finished videos, each finished job kept
    ``ttl_s`` seconds; ``clock`` gives unix seconds."""

    def __init__(self, max_jobs: int, max_bytes: int, ttl_s: float,
                 clock: Callable[[], float] = time.time) -> None:
        self.max_jobs = max_jobs
        self.max_bytes = max_bytes
        self.ttl_s = ttl_s
        self._clock = clock
        self._jobs: dict[str, VideoJob] = {}  # in creation order
        self.held_bytes = 0

    def now(self) -> float:
        """Unix seconds, by the store's clock."""
        return self._clock()

    def add(self, job: VideoJob) -> None:
        """Keeps ``job``; RESOURCE_EXHAUSTED (nothing kept) when ``max_jobs`` that have not failed
        are kept already."""
        self._expire()
        if sum(kept.status != FAILED for kept in self._jobs.values()) >= self.max_jobs:
            raise ServiceError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                               f"this worker keeps {self.max_jobs} video jobs already (--max-video-jobs): delete "
                               "completed ones, or retry once they expire", retry_after=1)
        self._jobs[job.id] = job

    def get(self, job_id: str) -> VideoJob:
        """The job; NOT_FOUND when it is unknown, deleted or expired."""
        self._expire()
        job = self._jobs.get(job_id)
        if job is None:
            raise ServiceError(grpc.StatusCode.NOT_FOUND, f"no video job {job_id[:80]!r} (unknown, deleted, or "
                                                          f"expired {self.ttl_s:g} s after it finished)")
        return job

    def jobs(self) -> list[VideoJob]:
        """Every job kept, oldest first."""
        self._expire()
        return list(self._jobs.values())

    def complete(self, job: VideoJob, content: bytes) -> None:
        """``job``'s video is done: kept when it fits ``max_bytes``, else the job fails saying so."""
        if self._jobs.get(job.id) is not job:  # deleted meanwhile
            return
        if self.held_bytes + len(content) > self.max_bytes:
            self.fail(job, JobError(grpc.StatusCode.RESOURCE_EXHAUSTED.name.lower(),
                                    f"the video is {len(content)} bytes, and finished videos hold {self.held_bytes} "
                                    f"of the {self.max_bytes} bytes this worker keeps (--max-video-bytes); download "
                                    "and delete finished videos, then create it again"))
            return
        self.held_bytes += len(content)
        job.content = content
        job.progress = 100
        self._end(job, COMPLETED)

    def fail(self, job: VideoJob, error: JobError) -> None:
        """``job`` failed: it no longer counts against ``max_jobs``, and the oldest failed job goes
        when more than ``max_jobs`` are kept."""
        if self._jobs.get(job.id) is job:
            job.error = error
            self._end(job, FAILED)
            failed = [kept for kept in self._jobs.values() if kept.status == FAILED]
            for oldest in failed[: len(failed) - self.max_jobs]:
                self._drop(oldest)

    def _end(self, job: VideoJob, status: str) -> None:
        ended = self.now()
        job.status = status
        job.completed_at = int(ended)
        job.expires_at = math.ceil(ended + self.ttl_s)

    async def delete(self, job_id: str) -> VideoJob:
        """Forgets the job, first cancelling its request and waiting for that to end when it is
        queued or running; NOT_FOUND when it is unknown."""
        job = self.get(job_id)
        task = job.task
        if task is not None and not task.done():
            task.cancel()
            await asyncio.wait({task})
        self._drop(job)
        return job

    def _drop(self, job: VideoJob) -> None:
        if self._jobs.pop(job.id, None) is job:
            self.held_bytes -= len(job.content)
            job.content = b""

    def _expire(self) -> None:
        now = self.now()
        for job in [job for job in self._jobs.values() if job.expires_at is not None and job.expires_at <= now]:
            self._drop(job)
