"""Scheduling by compute: deficit round robin between size classes by compute, and the runner load
budget; pure functions and the one stateful chooser, driven as the dispatch plan drives them."""

from __future__ import annotations

import pytest
from test_unit_logic import ids, job

from runner_service.denoising.size_turns import SizeTurns
from worker_service.scheduling.budget import DeficitRoundRobin, budget, cost, load, size_class
from worker_service.scheduling.jobs import Job

pytestmark = pytest.mark.unit


def drain(chooser: DeficitRoundRobin, queue: list[Job]) -> list[str]:
    """Sends every job, one at a time, in the order the chooser picks them."""
    order = []
    queue = list(queue)
    while queue:
        chosen = chooser.choose(queue)
        chooser.charge([chosen])
        queue.remove(chosen)
        order.append(chosen.request.request_id)
    return order


def test_load_cost_and_class_follow_images_pixels_and_steps() -> None:
    small, large = job("s", size=64, steps=20), job("l", size=128, steps=20, images=2)
    assert (load(small), load(large)) == (64 * 64, 2 * 128 * 128)
    assert (cost(small), cost(large)) == (64 * 64 * 20, 2 * 128 * 128 * 20)
    assert size_class(small) < size_class(large)
    assert size_class(job("a", size=96)) == size_class(job("b", size=128)), "one class up to the next power of two"


def test_one_size_class_is_first_in_first_out() -> None:
    queue = [job(f"j{i}", size=64) for i in range(5)]
    assert drain(DeficitRoundRobin(), queue) == [f"j{i}" for i in range(5)]


def test_classes_share_compute_equally_so_neither_size_starves() -> None:
    # Eight large requests queued first, then eight small ones a quarter their cost: FIFO would run
    # every large one before the first small one. By compute, each turn lets one large or four small through.
    large = [job(f"L{i}", size=128) for i in range(8)]
    small = [job(f"s{i}", size=64) for i in range(8)]
    order = drain(DeficitRoundRobin(), large + small)
    assert order == ["L0", "s0", "s1", "s2", "s3", "L1", "s4", "s5", "s6", "s7", "L2", "L3", "L4", "L5", "L6", "L7"]


def test_a_stream_of_small_requests_does_not_starve_a_large_one() -> None:
    chooser = DeficitRoundRobin()
    queue = [job("big", size=256)] + [job(f"s{i}", size=32) for i in range(4)]
    sent = []
    for i in range(4, 200):
        chosen = chooser.choose(queue)
        chooser.charge([chosen])
        queue.remove(chosen)
        sent.append(chosen.request.request_id)
        if chosen.request.request_id == "big":
            break
        queue.append(job(f"s{i}", size=32))  # one more small one arrives for every one sent
    assert sent[-1] == "big" and len(sent) <= 2 * (256 * 256) // (32 * 32), sent


def test_a_retried_job_goes_first_and_is_not_charged_again() -> None:
    chooser = DeficitRoundRobin()
    retried = job("retry", size=128, attempts=1)
    queue = [job("a", size=64), retried]
    assert chooser.choose(queue) is retried
    chooser.charge([retried])
    assert ids([chooser.choose([job("a", size=64)])]) == ["a"]


def test_the_budget_is_max_batch_size_images_of_the_largest_size_held() -> None:
    assert budget([job("a", size=64), job("b", size=128)], 4) == 4 * 128 * 128
    assert budget([], 4) == 0


def test_size_groups_of_a_step_batch_take_turns_by_compute() -> None:
    turns = SizeTurns()
    runs = [turns.due({"small": 1.0, "large": 3.0}) for _ in range(6)]
    assert [("small" in due, "large" in due) for due in runs] == [(True, False), (True, False), (True, True)] * 2
    assert turns.due({"large": 3.0}) == ["large"], "alone, a group runs at every step"
    assert turns.due({"large": 3.0, "new": 3.0}) == ["large", "new"]
