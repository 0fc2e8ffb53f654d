"""What the dispatcher sends where this round: a pure function of the queue, the runners' states,
the clock, the batch policy and the size classes' turns (the worker's SchedulerOutput).

Each round ``plan_dispatch`` takes the requests in serving order (``serving_order``: FIFO, or by
deadline under ``--schedule deadline``) and hands out batches until no runner has room for the
next one, or the next one is still filling (``DispatchPlan.wait``):

- **in order**: the head of the queue goes to the ready runner with the most room for it in images
  (a request of more images than the batch size runs alone, on a runner running nothing), then
  the one that has run the fewest batches, with the compatible requests that fit beside it;
- **by compute**, when every ready runner takes its step batch's size groups in turns
  (``--step-schedule budget``, reported as ``RunnerInfo.step_schedule``): the head is the size
  class whose turn it is (``budget.DeficitRoundRobin``; within a class, serving order), and goes to
  the runner with the most load room that it fits (``_pick_by_budget``). The worker thus follows
  its runners: one flag, the runner's, chooses budget scheduling for both sides, and a worker never
  takes turns a runner would undo by stepping every size at every step.

A step-batching runner gets each request of the tasks its loop steps as an Execute of its own
(it batches them at steps all the same: a cancelled one then leaves at the next step, not with the
last of its batch), without waiting for a batch to fill; other tasks run as one Execute per batch.
A batch waits to fill (``BatchPolicy.max_batch_delay``) only while its runner is running something or
other requests are queued: a lone request on an idle runner starts at once, as waiting for company
that has not come would only add the delay to it.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass, replace

from diffusion.v1 import common_pb2
from worker_service.runners import RunnerHandle
from worker_service.scheduling.batching import BatchPolicy, select_batch, serving_order
from worker_service.scheduling.budget import DeficitRoundRobin, budget, load
from worker_service.scheduling.jobs import Job


@dataclass(frozen=True)
class RunnerView:
    """What planning knows of one runner: its handle's state when the round began, and what the
    plan has given it since (``started``)."""

    target: str
    ready: bool
    room: int  # images it may be sent (``RunnerHandle.room``)
    step_batching: bool = False  # several Executes may run on it at once
    stepped_tasks: frozenset[int] = frozenset()  # the tasks whose requests join its batch at steps
    takes_turns: bool = False  # its size groups take turns by compute (--step-schedule budget)
    batches: int = 0  # batches started on it so far
    running: tuple[Job, ...] = ()  # the requests running on it

    @classmethod
    def of(cls, runner: RunnerHandle, max_images: int) -> RunnerView:
        return cls(target=runner.target, ready=runner.ready, room=runner.room(max_images),
                   step_batching=runner.step_batching, stepped_tasks=runner.stepped_tasks,
                   takes_turns=runner.takes_turns, batches=runner.batches, running=runner.running_jobs)

    def steps(self, task: common_pb2.Task) -> bool:
        """Whether its requests of ``task`` join its running batch at step boundaries."""
        return task in self.stepped_tasks

    def started(self, jobs: Sequence[Job], executes: int) -> RunnerView:
        """This runner once ``jobs`` start on it in ``executes`` Executes: a runner that does not
        batch at steps (or a video, which runs alone) has no room left beside them."""
        taken = self.room if any(job.video for job in jobs) else sum(job.images for job in jobs)
        return replace(self, room=max(self.room - taken, 0) if self.step_batching else 0,
                       batches=self.batches + executes, running=(*self.running, *jobs))


@dataclass(frozen=True)
class ScheduledBatch:
    """One runner Execute: ``jobs`` (of one batch key) on the runner at ``target``."""

    target: str
    jobs: tuple[Job, ...]


@dataclass(frozen=True)
class DispatchPlan:
    """The round's decision: the Executes to start, in order; ``wait``: seconds until the next
    batch could have filled (None: nothing to wait for); ``turns``: the size classes' turns once
    these are sent; ``by_budget``: whether the round scheduled by compute."""

    batches: tuple[ScheduledBatch, ...]
    wait: float | None
    turns: DeficitRoundRobin
    by_budget: bool


def schedules_by_budget(runners: Sequence[RunnerView]) -> bool:
    """Whether the worker schedules by compute: every ready runner takes turns by compute (a pool of
    mixed schedules runs in serving order, each runner stepping by its own)."""
    ready = [runner for runner in runners if runner.ready]
    return bool(ready) and all(runner.takes_turns for runner in ready)


def plan_dispatch(queue: Sequence[Job], runners: Sequence[RunnerView], policy: BatchPolicy, now: float,
                  turns: DeficitRoundRobin) -> DispatchPlan:
    """Every batch that can start now (see the module's docstring). ``turns`` is left as it was:
    the plan carries the turns once its batches are sent."""
    turns = copy.deepcopy(turns)
    views = list(runners)
    by_budget = schedules_by_budget(views)
    waiting = serving_order(queue, policy)
    scheduled: list[ScheduledBatch] = []
    wait = None
    while waiting:
        if by_budget:
            head = turns.choose(waiting)
            waiting = [head, *(job for job in waiting if job is not head)]
            held = [job for view in views for job in view.running] + waiting
            index, room = _pick_by_budget(head, views, budget(held, policy.max_batch_size), policy.max_batch_size)
        else:
            head = waiting[0]
            index, room = _pick_in_order(head, views, policy.max_batch_size)
        if index is None:
            break
        runner = views[index]
        stepped = runner.steps(head.request.task)
        busy = bool(runner.running) or len(waiting) > 1
        batch, wait = select_batch(waiting, policy, now, room, fill=busy and not stepped)
        if not batch:
            break
        if by_budget:
            turns.charge(batch)
        executes = [[job] for job in batch] if stepped else [batch]
        scheduled += [ScheduledBatch(runner.target, tuple(jobs)) for jobs in executes]
        views[index] = runner.started(batch, len(executes))
        waiting = [job for job in waiting if job not in batch]
    return DispatchPlan(tuple(scheduled), wait, turns, by_budget)


def _pick_in_order(head: Job, runners: Sequence[RunnerView], max_images: int) -> tuple[int | None, int]:
    """The runner with the most room for ``head`` (then the fewest batches run), and its room in
    images; a request of more images than the batch size needs a runner running nothing."""
    need = max_images if head.video else min(head.images, max_images)
    fitting = [index for index, runner in enumerate(runners) if runner.room >= need]
    if not fitting:
        return None, 0
    index = max(fitting, key=lambda i: (runners[i].room, -runners[i].batches))
    return index, runners[index].room


def _pick_by_budget(head: Job, runners: Sequence[RunnerView], limit: int,
                    max_images: int) -> tuple[int | None, int]:
    """The ready runner with the most load room (``limit`` less what it runs) that ``head`` fits,
    then the fewest batches run: a step-batching one beside what it runs, another once idle (one
    running nothing takes any request); and the images it may be sent: ``head``'s request alone
    on a step-batching runner, so the next request is chosen by the round robin again. A video runs
    alone: only on a runner running nothing, and nothing joins it."""
    fitting = []
    for index, runner in enumerate(runners):
        if not runner.ready:
            continue
        running = runner.running
        if running and (not runner.step_batching or head.video or any(job.video for job in running)):
            continue
        room = limit - sum(load(job) for job in running)
        if not running or room >= load(head):
            fitting.append((room, -runner.batches, index))
    if not fitting:
        return None, 0
    _, _, index = max(fitting, key=lambda fit: fit[:2])
    return index, head.images if runners[index].step_batching else max_images
