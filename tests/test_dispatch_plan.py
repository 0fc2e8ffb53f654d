"""The dispatcher's plan (``worker_service.scheduling.plan``): what goes to which runner each round,
a pure function of the queue, the runners' states, the clock and the turns, tested without asyncio,
gRPC or runners."""

from __future__ import annotations

import copy

import pytest
from test_unit_logic import ids, job

from diffusion.v1 import common_pb2, worker_pb2
from fake_runner import VIDEO
from worker_service.config import Limits
from worker_service.scheduling.batching import BatchPolicy
from worker_service.scheduling.budget import DeficitRoundRobin
from worker_service.scheduling.jobs import Job
from worker_service.scheduling.plan import DispatchPlan, RunnerView, plan_dispatch, schedules_by_budget
from worker_service.validation import normalize

pytestmark = pytest.mark.unit

T2I = common_pb2.TASK_TEXT_TO_IMAGE
NOW = 10.0
POLICY = BatchPolicy(max_batch_size=2, max_batch_delay=0.0)


def request_level(target: str, **state: object) -> RunnerView:
    """A ready runner of a model that runs each Execute as one pipeline call: one batch at a time."""
    return RunnerView(target, **{"ready": True, "room": POLICY.max_batch_size, **state})


def stepping(target: str, takes_turns: bool = False, **state: object) -> RunnerView:
    """A ready runner whose text-to-image requests join its running batch at the next step."""
    return RunnerView(target, **{"ready": True, "room": POLICY.max_batch_size, "step_batching": True,
                                 "stepped_tasks": frozenset({T2I}), "takes_turns": takes_turns, **state})


def sent(plan: DispatchPlan) -> list[tuple[str, list[str]]]:
    """Each Execute of the plan: its runner and its requests."""
    return [(batch.target, ids(list(batch.jobs))) for batch in plan.batches]


def video(request_id: str) -> Job:
    model = common_pb2.ModelInfo(size_multiple=8, capabilities=common_pb2.ModelCapabilities(
        tasks=[T2I, common_pb2.TASK_TEXT_TO_VIDEO], video=VIDEO))
    return Job(normalize(worker_pb2.GenerateRequest(request_id=request_id, width=64, height=64, seed=1, num_frames=5,
                                                    task=common_pb2.TASK_TEXT_TO_VIDEO), Limits(), set(), model=model),
               deadline=None)


# -- in order -----------------------------------------------------------------------------------

def test_in_order_a_batch_goes_to_the_runner_with_the_most_room_then_the_fewest_batches() -> None:
    queue = [job("a"), job("b"), job("wide", size=128), job("c")]
    runners = [request_level("busy", room=0), request_level("used", batches=3), request_level("fresh")]
    plan = plan_dispatch(queue, runners, POLICY, NOW, DeficitRoundRobin())
    # The head and a compatible request share one Execute; the next batch goes to the other idle runner.
    assert sent(plan) == [("fresh", ["a", "b"]), ("used", ["wide"])]
    assert not plan.by_budget and plan.wait is None


def test_a_step_batching_runner_gets_one_execute_per_request_while_it_has_room() -> None:
    queue = [job("a"), job("b"), job("c")]
    plan = plan_dispatch(queue, [stepping("s", running=(job("running"),), room=1)], POLICY, NOW, DeficitRoundRobin())
    assert sent(plan) == [("s", ["a"])], "room for one image beside the one running"
    plan = plan_dispatch(queue, [stepping("s")], POLICY, NOW, DeficitRoundRobin())
    assert sent(plan) == [("s", ["a"]), ("s", ["b"])], "each its own Execute, up to the batch size in all"


def test_a_batch_still_filling_waits_on_a_request_level_runner_but_not_on_a_step_batching_one() -> None:
    policy = BatchPolicy(max_batch_size=2, max_batch_delay=1.0)
    queue = [job("a", admitted_at=NOW - 0.25), job("wide", size=128, admitted_at=NOW - 0.1)]
    plan = plan_dispatch(queue, [request_level("r")], policy, NOW, DeficitRoundRobin())
    assert plan.batches == () and plan.wait == pytest.approx(0.75), "others are queued: the head may get company"
    plan = plan_dispatch(queue, [stepping("s")], policy, NOW, DeficitRoundRobin())
    assert sent(plan) == [("s", ["a"]), ("s", ["wide"])] and plan.wait is None


def test_a_lone_request_on_an_idle_runner_starts_at_once_and_waits_to_fill_beside_running_work() -> None:
    policy = BatchPolicy(max_batch_size=2, max_batch_delay=1.0)
    queue = [job("a", admitted_at=NOW - 0.25)]
    plan = plan_dispatch(queue, [request_level("r")], policy, NOW, DeficitRoundRobin())
    assert sent(plan) == [("r", ["a"])] and plan.wait is None, "nothing running, nothing queued: no delay"
    # A runner that steps other tasks, running one, has room beside it: the head waits for company.
    busy = stepping("s", stepped_tasks=frozenset(), running=(job("running"),), room=2)
    plan = plan_dispatch(queue, [busy], policy, NOW, DeficitRoundRobin())
    assert plan.batches == () and plan.wait == pytest.approx(0.75)


def test_nothing_is_planned_without_a_runner_with_room_for_the_head() -> None:
    queue = [job("two", images=2)]
    plan = plan_dispatch(queue, [stepping("s", room=1), request_level("down", ready=False, room=0)], POLICY, NOW,
                         DeficitRoundRobin())
    assert plan.batches == () and plan.wait is None


def test_a_video_goes_alone_to_a_runner_running_nothing() -> None:
    queue = [video("v"), job("a")]
    runners = [stepping("beside", running=(job("running"),), room=1), stepping("idle")]
    assert sent(plan_dispatch(queue, runners, POLICY, NOW, DeficitRoundRobin())) == [("idle", ["v"]),
                                                                                     ("beside", ["a"])]


def test_deadline_order_picks_the_head() -> None:
    policy = BatchPolicy(max_batch_size=1, max_batch_delay=0.0, by_deadline=True)
    queue = [job("none", admitted_at=1.0), job("soon", admitted_at=2.0, deadline=NOW + 1, size=128)]
    assert sent(plan_dispatch(queue, [request_level("r")], policy, NOW, DeficitRoundRobin())) == [("r", ["soon"])]


# -- by compute --------------------------------------------------------------------------------

def test_when_every_ready_runner_takes_turns_requests_go_by_compute() -> None:
    """Room for 2 of the largest size held (128x128): beside the large request, four of a quarter its
    pixels (in order, by images, one would fit); the small class's turn comes after the large one's."""
    queue = [job("L1", size=128), job("L2", size=128), *(job(f"s{i}") for i in range(1, 6))]
    runners = [stepping("s", takes_turns=True), request_level("down", ready=False, room=0)]
    plan = plan_dispatch(queue, runners, POLICY, NOW, DeficitRoundRobin())
    assert plan.by_budget
    assert sent(plan) == [("s", ["L1"]), ("s", ["s1"]), ("s", ["s2"]), ("s", ["s3"]), ("s", ["s4"])]


def test_a_pool_whose_ready_runners_do_not_all_take_turns_is_served_in_order() -> None:
    turns = [stepping("a", takes_turns=True), stepping("b")]
    assert schedules_by_budget(turns[:1]) and not schedules_by_budget(turns) and not schedules_by_budget([])
    assert schedules_by_budget([turns[0], RunnerView("restarting", ready=False, room=0)])
    queue = [job("L1", size=128), job("L2", size=128), *(job(f"s{i}") for i in range(1, 4))]
    plan = plan_dispatch(queue, turns, POLICY, NOW, DeficitRoundRobin())
    assert not plan.by_budget
    assert sent(plan) == [("a", ["L1"]), ("a", ["L2"]), ("b", ["s1"]), ("b", ["s2"])]


def test_planning_leaves_the_turns_it_is_given_and_the_plan_carries_them_on() -> None:
    """Two size classes: the large one's turn sends L1, and with it charged the small one's turn
    comes; the same inputs plan the same again, as the turns given are left as they were."""
    queue = [job("L1", size=128), job("L2", size=128), job("s1")]
    one_at_a_time = BatchPolicy(max_batch_size=1, max_batch_delay=0.0)
    runner = [request_level("r", room=1, takes_turns=True)]
    turns = DeficitRoundRobin()
    before = copy.deepcopy(vars(turns))
    first = plan_dispatch(queue, runner, one_at_a_time, NOW, turns)
    assert sent(first) == [("r", ["L1"])] and vars(turns) == before
    assert sent(plan_dispatch(queue, runner, one_at_a_time, NOW, turns)) == sent(first)
    assert sent(plan_dispatch(queue[1:], runner, one_at_a_time, NOW, first.turns)) == [("r", ["s1"])]


def test_by_compute_a_class_is_served_in_deadline_order() -> None:
    policy = BatchPolicy(max_batch_size=1, max_batch_delay=0.0, by_deadline=True)
    queue = [job("late", admitted_at=1.0, deadline=NOW + 30), job("soon", admitted_at=2.0, deadline=NOW + 1)]
    plan = plan_dispatch(queue, [request_level("r", room=1, takes_turns=True)], policy, NOW, DeficitRoundRobin())
    assert plan.by_budget and sent(plan) == [("r", ["soon"])]
