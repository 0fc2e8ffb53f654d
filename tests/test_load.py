"""A bounded load test against a worker with two runners (fake runner processes: the load is on the
worker): 16 concurrent clients x 3 requests, every request accounted for, with a small queue (some
RESOURCE_EXHAUSTED) and a large one (none); streams see their queue position move; SIGTERM drains
with several runners."""

from __future__ import annotations

import collections
import contextlib
import signal
import threading
import time

import grpc
import pytest

from diffusion.v1 import worker_pb2, worker_pb2_grpc
from harness.processes import start_fake_runner, start_worker, wait_until

pytestmark = pytest.mark.process
W = worker_pb2
CLIENTS, PER_CLIENT, STEPS = 16, 3, 3
STEP_S = 0.05  # a batch takes 0.15 s: the clients outrun the runners


@pytest.fixture(scope="module")
def runners(tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("load-runners")
    started = [start_fake_runner(log_dir, STEP_S) for _ in range(2)]
    yield started
    for runner in started:
        runner.stop()


def start(tmp_path, runners, *args: str):
    extra = [a for r in runners[1:] for a in ("--runner", r.target)]
    worker = start_worker(tmp_path, runners[0].target, *extra, *args)
    channel = grpc.insecure_channel(worker.target)
    stub = worker_pb2_grpc.WorkerServiceStub(channel)
    wait_until(lambda: all(r.ready for r in stub.GetStatus(W.GetStatusRequest(), timeout=5).runners), 60,
               "both runners ready")
    return worker, channel, stub


def run_load(stub) -> tuple[collections.Counter, list[str]]:
    """CLIENTS threads, PER_CLIENT requests each; odd clients stream. Returns outcome counts and
    the problems found in the streams' event order."""
    outcomes: collections.Counter = collections.Counter()
    problems: list[str] = []
    lock = threading.Lock()
    barrier = threading.Barrier(CLIENTS)

    def client(index: int) -> None:
        barrier.wait()
        for n in range(PER_CLIENT):
            req = W.GenerateRequest(request_id=f"c{index}-{n}", num_inference_steps=STEPS, seed=index * 10 + n)
            try:
                if index % 2:
                    events = list(stub.GenerateStream(W.GenerateStreamRequest(request=req), timeout=60))
                    problem = check_stream(events)
                    if problem:
                        with lock:
                            problems.append(f"{req.request_id}: {problem}")
                else:
                    assert stub.Generate(req, timeout=60).images
                code = "OK"
            except grpc.RpcError as error:
                code = error.code().name
            with lock:
                outcomes[code] += 1

    threads = [threading.Thread(target=client, args=(i,)) for i in range(CLIENTS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
        assert not thread.is_alive(), "a client hangs"
    return outcomes, problems


def check_stream(events: list) -> str:
    kinds = [e.WhichOneof("event") for e in events]
    if not kinds or kinds[-1] != "done" or "started" not in kinds:
        return f"bad ending {kinds}"
    started = kinds.index("started")
    positions = [e.queued.position for e in events[:started]]
    if set(kinds[:started]) != {"queued"} or positions != sorted(positions, reverse=True) \
            or len(set(positions)) != len(positions):
        return f"queue positions {positions}"
    if [e.progress.step for e in events[started + 1:-1]] != list(range(1, STEPS + 1)):
        return f"progress {kinds[started:]}"
    return ""


@pytest.mark.parametrize("max_queue, expect_refusals", [(2, True), (64, False)])
def test_bounded_load_every_request_accounted_for(runners, tmp_path, max_queue, expect_refusals):
    worker, channel, stub = start(tmp_path, runners, "--max-queue", str(max_queue))
    try:
        started = time.monotonic()
        outcomes, problems = run_load(stub)
        elapsed = time.monotonic() - started
        print(f"--max-queue {max_queue}: {dict(outcomes)} of {CLIENTS * PER_CLIENT} in {elapsed:.1f} s")
        assert sum(outcomes.values()) == CLIENTS * PER_CLIENT
        assert set(outcomes) <= {"OK", "RESOURCE_EXHAUSTED"}, outcomes
        assert outcomes["OK"] > 0
        assert (outcomes["RESOURCE_EXHAUSTED"] > 0) == expect_refusals, outcomes
        assert not problems, problems
        # The last batches' Execute calls end just after their results were delivered.
        status = wait_until(lambda: (s := stub.GetStatus(W.GetStatusRequest(), timeout=5)).requests_in_flight == 0
                            and s, 30, "no request in flight")
        assert status.queue_depth == 0
        sizes = collections.Counter(line.split("batch of ")[1].split()[0] for line in worker.log().splitlines()
                                    if "batch of " in line)
        used = {line.split(" on runner ")[1].split(": ")[0] for line in worker.log().splitlines()
                if "batch of " in line}
        print(f"batches by size: {dict(sizes)}; runners used: {len(used)}")
        assert len(used) == 2
    finally:
        channel.close()
        worker.stop()


def test_sigterm_drains_with_several_runners(runners, tmp_path):
    worker, channel, stub = start(tmp_path, runners, "--grace", "60", "--max-batch-size", "1",
                                  "--runner-keepalive", "0")  # frozen runners are not lost ones
    try:
        with contextlib.ExitStack() as frozen:  # every request stays running or queued while it drains
            for runner in runners:
                frozen.enter_context(runner.frozen())
            futures = [stub.Generate.future(W.GenerateRequest(num_inference_steps=30, seed=i), timeout=120)
                       for i in range(4)]
            # Every request accepted (two running, two queued) before the signal: the ones that have
            # not reached the worker yet would rightly be refused as draining.
            wait_until(lambda: (s := stub.GetStatus(W.GetStatusRequest(), timeout=5)).requests_in_flight == 2
                       and s.queue_depth == 2, 30, "two requests running, two queued")
            worker.process.send_signal(signal.SIGTERM)
            wait_until(lambda: stub.GetStatus(W.GetStatusRequest(), timeout=5).state == W.WORKER_STATE_DRAINING,
                       30, "DRAINING")
            with pytest.raises(grpc.RpcError) as caught:
                stub.Generate(W.GenerateRequest(num_inference_steps=2), timeout=10)
            assert caught.value.code() == grpc.StatusCode.UNAVAILABLE and "draining" in caught.value.details()
        assert all(f.result().images for f in futures)  # running and queued ones alike
        assert worker.process.wait(60) == 0
    finally:
        channel.close()
        worker.stop()
