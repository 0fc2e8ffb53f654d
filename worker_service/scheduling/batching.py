"""Which queued requests run together: pure functions of the queue, the clock and the limits."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from worker_service.config import DEADLINE_AGING_S
from worker_service.scheduling.jobs import Job


@dataclass(frozen=True)
class BatchPolicy:
    """At most ``max_batch_size`` images per Execute; the head of the queue waits up to
    ``max_batch_delay`` seconds after it arrived for compatible requests to fill the batch. Input
    images add at most ``max_input_bytes`` to an Execute beyond the head's (half the message limit)."""

    max_batch_size: int = 4
    max_batch_delay: float = 0.005
    max_input_bytes: int = 32 * 1024 * 1024
    # The earliest deadline first, instead of the oldest (--schedule deadline).
    by_deadline: bool = False


def serving_order(queue: Sequence[Job], policy: BatchPolicy) -> list[Job]:
    """The queue in the order it is served: as it came (FIFO), or the earliest due first (``due``)
    under ``policy.by_deadline``."""
    return sorted(queue, key=due) if policy.by_deadline else list(queue)  # stable: FIFO among equals


def select_batch(queue: Sequence[Job], policy: BatchPolicy, now: float, room: int | None = None,
                 fill: bool = True) -> tuple[list[Job], float | None]:
    """The next batch from ``queue``, in the order it is served (``serving_order``): its head,
    then compatible requests in order, as many images as fit (``room``: fewer than the batch size
    are free on the runner). Returns ([], seconds to wait) while the batch could still fill within
    the delay (when ``fill``); a retried head never waits. The head is always in the next batch,
    so no request starves. A video runs alone: its Execute's memory and time are the frames', and
    nothing joins it."""
    limit = policy.max_batch_size if room is None else min(room, policy.max_batch_size)
    head = queue[0]
    key = head.batch_key()
    batch, images, inputs = [head], head.images, head.input_bytes
    if head.video:
        return batch, None
    for job in queue[1:]:
        if images >= limit:
            break
        if job.batch_key() == key and images + job.images <= limit and \
                inputs + job.input_bytes <= max(policy.max_input_bytes, head.input_bytes):
            batch.append(job)
            images += job.images
            inputs += job.input_bytes
    fill_until = head.admitted_at + policy.max_batch_delay
    if fill and images < limit and now < fill_until and head.attempts == 0:
        return [], fill_until - now
    return batch, None


def due(job: Job) -> float:
    """When a job is due under --schedule deadline: its deadline, or ``DEADLINE_AGING_S`` after it
    arrived when it has none, so a request without a deadline still runs under a stream of
    requests with one. A retried job comes first, as in FIFO."""
    if job.attempts:
        return float("-inf")
    return job.deadline if job.deadline is not None else job.admitted_at + DEADLINE_AGING_S


def retry_seconds(elapsed_ms: float, step: int, total_steps: int, last_ms_per_step: float) -> float:
    """About how long a retry of a batch takes: every step again, at this attempt's pace, or the
    last pace seen for the shape when it failed before its first step (0 when never seen)."""
    pace = elapsed_ms / step if step else last_ms_per_step
    return pace * total_steps / 1000
