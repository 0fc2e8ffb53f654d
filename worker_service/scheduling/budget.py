"""Scheduling by compute: requests admitted to runners by their compute, and deficit round robin
between size classes (vLLM-Omni's compute-budget scheduling), while every ready runner takes its
step batch's size groups in turns too (``--step-schedule budget``; ``plan.schedules_by_budget``).

A request's load is what it adds to every denoising step of the batch it joins: its images times
its pixels (a step's time grows with the pixels it denoises), times its frames for a video. A
runner takes requests while their loads fit its budget: ``--max-batch-size`` images of the largest
size the worker now holds (queued or running). With one size, that is FIFO's count of images;
with mixed sizes, a 64x64 request takes a quarter of a 128x128 one's room, so several small
requests join where FIFO would keep them queued behind a count of large ones. A video runs alone.

Which request goes next is decided between size classes (pixels rounded up to a power of two), by
deficit round robin over their cost: images x frames x pixels x steps, the compute a request consumes in
all. Each class in turn earns a quantum (the largest head cost, so every visit lets one through)
and spends it on its oldest requests; a class that empties loses its deficit. Classes thus share
the device's compute equally whatever their sizes: small requests are not starved by large ones,
nor large by a stream of small ones. When the chosen request does not fit the runner's room,
nothing else is sent in its place; it goes first once room frees, so its wait is bounded by one
round of the other classes' quanta. Each request's wait is reported as its ``queue_ms``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from worker_service.scheduling.jobs import Job


def load(job: Job) -> int:
    """What the job adds to each step of its batch: images x frames x pixels."""
    return job.images * job.frames * job.request.width * job.request.height


def cost(job: Job) -> int:
    """The compute the job consumes in all: images x frames x pixels x steps."""
    return load(job) * job.request.num_inference_steps


def size_class(job: Job) -> int:
    """The job's size class: its pixel count (a video's, of all its frames) rounded up to a power of
    two (its bit length)."""
    return (job.frames * job.request.width * job.request.height - 1).bit_length()


def budget(held: Iterable[Job], max_batch_size: int) -> int:
    """A runner's load budget: ``max_batch_size`` images of the largest size among the jobs held (a
    video runs alone whatever its load: the plan's rule)."""
    return max_batch_size * max((job.request.width * job.request.height for job in held), default=0)


class DeficitRoundRobin:
    """The one owner of the size classes' deficits and of whose turn it is."""

    def __init__(self) -> None:
        self._deficits: dict[int, int] = {}
        self._turn: int | None = None  # the class being served: it keeps the turn while its deficit lasts

    def choose(self, queue: Sequence[Job]) -> Job:
        """The next job to send, by deficit round robin between the queue's size classes (a retried
        job first, as in FIFO). Charged only by ``charge``, once it is sent."""
        retried = next((job for job in queue if job.attempts), None)
        if retried is not None:
            return retried
        heads: dict[int, Job] = {}
        for job in queue:
            heads.setdefault(size_class(job), job)
        self._deficits = {cls: deficit for cls, deficit in self._deficits.items() if cls in heads}
        order = sorted(heads)
        if self._turn not in heads:
            self._turn = next((cls for cls in order if self._turn is None or cls > self._turn), order[0])
        quantum = max(cost(head) for head in heads.values())
        turn = self._turn
        while cost(heads[turn]) > self._deficits.get(turn, 0):
            # Its deficit is spent: the next class's turn, with one more quantum.
            turn = order[(order.index(turn) + 1) % len(order)]
            self._deficits[turn] = self._deficits.get(turn, 0) + quantum
        self._turn = turn
        return heads[turn]

    def charge(self, jobs: Iterable[Job]) -> None:
        """Spends the cost of jobs sent from their classes' deficits (a retried job is not charged again)."""
        for job in jobs:
            if job.attempts == 0:
                cls = size_class(job)
                self._deficits[cls] = max(self._deficits.get(cls, 0) - cost(job), 0)
