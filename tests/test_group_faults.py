"""A runner group's rank lost or failing, served through the worker (issue 27): kill -9 of rank 1
ends the group, whose replacement the worker reloads with the same plan and retries the request on,
with the same bytes; so does SIGSTOP of rank 1, which only the ranks' heartbeat notices; a load that
fails on rank 1 alone changes nothing and says so. Rank 1 out of memory mid-request, and what the
group computes: ``test_group_served``. The group: ``fixtures_group``."""

from __future__ import annotations

import os
import resource
import signal

import grpc
import pytest

from diffusion.v1 import worker_pb2 as W
from fixtures_group import CFG, GROUP_ARGS, MODEL, ULYSSES, Served, ask, cap_address_space, rank_1_pid, status
from harness.processes import start_runner, wait_until
from harness.streams import Stream

pytestmark = [pytest.mark.process, pytest.mark.slow, pytest.mark.timeout(600)]


@pytest.mark.parametrize("lost", ["killed", "stopped"])
def test_a_rank_1_killed_or_stopped_ends_the_group_and_the_worker_retries_on_its_replacement(group: Served,
                                                                                             lost: str) -> None:
    """Rank 1 is killed (kill -9), or stopped (SIGSTOP: alive, but it runs nothing, so no death is
    ever seen and only the heartbeat tells), while a request is in flight: rank 0 ends with code 3,
    a new group takes the runner's address (the pod's or Kubernetes' restart), the worker loads it
    with the same plan and retries the request on it, which gives the undisturbed request's bytes.

    The request is held in flight whatever the machine's speed: both ranks are frozen before it is
    sent, so the group cannot finish it; rank 0 is continued once the worker has sent it."""
    plan = status(group).runners[0].info.model.parallel
    restarts = status(group).runners[0].restarts
    baseline = group.stub.Generate(ask(f"baseline-{lost}", guided=True), timeout=300)
    # The baseline's result reaches the client before its Execute stream ends: frozen in between, the
    # runner would look busy to the worker, which then queues the request instead of sending it.
    wait_until(lambda: idle(status(group).runners[0]), 60, "the runner idle after the baseline")
    rank_1 = rank_1_pid(group)
    os.kill(rank_1, signal.SIGSTOP)
    with group.runner.frozen():
        stream = Stream(group.stub, ask(lost, guided=True), timeout=300)
        stream.wait_for("started")
        if lost == "killed":
            os.kill(rank_1, signal.SIGKILL)
    # Stopped, rank 1 is ended by rank 0 after --group-heartbeat-timeout (5 s); killed, at once.
    assert group.runner.process.wait(60) == 3  # RANK_DIED_EXIT: the group ended as one
    if lost == "stopped":
        assert "the group's heartbeat failed" in group.runner.log()
    group.runner = start_runner(group.log_dir, *GROUP_ARGS, target=group.runner.target)
    stream.join(300)
    assert stream.error is None, stream.error
    assert stream.done.images[0].data == baseline.images[0].data
    assert stream.kinds.count("started") == 2
    wait_until(lambda: status(group).runners[0].info.model.parallel == plan, 120, "the plan loaded again")
    assert status(group).runners[0].restarts == restarts + 1


def idle(runner: W.RunnerStatus) -> bool:
    return runner.ready and runner.requests_in_flight == 0


def test_a_load_that_fails_on_rank_1_alone_changes_nothing_and_says_so(group: Served) -> None:
    """A real lone failure at Init: rank 1 cannot map the new model (its address space capped), so
    the load fails everywhere at once, naming rank 1, and every rank keeps the model it had."""
    group.stub.Init(W.InitRequest(model=MODEL, parallel=CFG), timeout=300)
    before = group.stub.Generate(ask("before-failed-load", guided=True), timeout=120)
    rank_1 = rank_1_pid(group)
    held = cap_address_space(rank_1)
    try:
        with pytest.raises(grpc.RpcError) as failed:
            group.stub.Init(W.InitRequest(model="shapes", parallel=ULYSSES), timeout=300)
    finally:
        resource.prlimit(rank_1, resource.RLIMIT_AS, held)
    assert failed.value.code() == grpc.StatusCode.FAILED_PRECONDITION, failed.value.details()
    assert "rank 1" in failed.value.details()
    model = status(group).runners[0].info.model
    assert (model.source, model.parallel) == (MODEL, CFG)
    after = group.stub.Generate(ask("after-failed-load", guided=True), timeout=120)
    assert after.images[0].data == before.images[0].data  # both ranks still hold the same model
