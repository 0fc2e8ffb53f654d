"""Cancellation, deadlines, the bounded queue and draining on SIGTERM: the worker's policy, against
the fake runner process, with one smoke test on a real runner.

What must happen while a request runs happens with the runner frozen (SIGSTOP): the request stays
in flight however fast the machine. The worker's keepalive to the runner is off, so a frozen runner
is not taken for a lost one; whether the runner stopped early is read in its log, not timed.
"""

from __future__ import annotations

import re
import signal

import grpc
import pytest

from diffusion.v1 import worker_pb2, worker_pb2_grpc
from harness.processes import ServiceProcess, start_worker, wait_until
from harness.streams import Stream
from support import Pair

pytestmark = pytest.mark.process
W = worker_pb2
LONG_STEPS = 200
STEP_S = 0.05  # the fake runner's step: LONG_STEPS take 10 s, which no test waits for


@pytest.fixture(scope="module")
def pair(serve):
    return serve("--max-queue", "1", "--max-batch-size", "1",  # one request runs at a time: the rest queue
                 "--runner-keepalive", "0", fake_step_s=STEP_S)


@pytest.fixture(scope="module")
def runner(pair: Pair) -> ServiceProcess:
    return pair.runner


def start_stream(stub, request_id: str, steps: int = LONG_STEPS) -> Stream:
    return Stream(stub, W.GenerateRequest(request_id=request_id, num_inference_steps=steps, seed=1))


def wait_progress(stream: Stream, steps: int = 3) -> None:
    for _ in range(steps):
        stream.wait_for("progress")


def quick(stub) -> W.GenerateResponse:
    return stub.Generate(W.GenerateRequest(num_inference_steps=2, seed=2), timeout=60)


def stopped_after(runner: ServiceProcess, request_id: str) -> int:
    """The step after which the runner dropped ``request_id`` because its call ended (from its log)."""
    pattern = re.compile(rf"stopped {re.escape(request_id)} after step (\d+): the call ended")
    found = wait_until(lambda: pattern.search(runner.log()), 60, f"the runner to stop {request_id}")
    return int(found.group(1))


def test_cancel_stops_a_running_request_within_a_few_steps(runner, stub):
    stream = start_stream(stub, "cancel-running")
    wait_progress(stream)
    with runner.frozen():
        assert stub.Cancel(W.CancelRequest(request_id="cancel-running"), timeout=5).was == "running"
        stream.finish()
    assert stream.error is not None and stream.error.code() == grpc.StatusCode.CANCELLED
    assert "cancelled by Cancel" in stream.error.details()
    # The runner stopped denoising at a step boundary, not after the rest of the 200 steps.
    assert stopped_after(runner, "cancel-running") < LONG_STEPS
    assert quick(stub).images


def test_client_deadline_stops_the_runner(runner, stub):
    stream = Stream(stub, W.GenerateRequest(request_id="deadline", num_inference_steps=LONG_STEPS, seed=1),
                    timeout=5)
    stream.wait_for("progress")
    with runner.frozen():  # the deadline passes mid-request
        stream.join(30)
    assert stream.error is not None and stream.error.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert stopped_after(runner, "deadline") < LONG_STEPS
    assert quick(stub).images


def test_client_cancel_stops_the_runner(runner, stub):
    stream = start_stream(stub, "client-cancel")
    wait_progress(stream)
    with runner.frozen():
        stream.call.cancel()
        stream.finish()
    assert stopped_after(runner, "client-cancel") < LONG_STEPS
    assert quick(stub).images


def test_full_queue_is_resource_exhausted_and_positions_move(runner, stub):
    running = start_stream(stub, "q-running")
    running.wait_for("progress")
    with runner.frozen():
        queue_full_while_running(stub, running)
    assert quick(stub).images


def queue_full_while_running(stub, running: Stream) -> None:
    waiting = start_stream(stub, "q-waiting")
    assert waiting.wait_for("queued").queued.position == 0
    with pytest.raises(grpc.RpcError) as caught:
        stub.Generate(W.GenerateRequest(num_inference_steps=2), timeout=10)
    assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "retry" in caught.value.details()
    status = stub.GetStatus(W.GetStatusRequest(), timeout=5)
    assert (status.queue_depth, status.requests_in_flight) == (1, 1)
    # A clashing id is refused while the request is active.
    with pytest.raises(grpc.RpcError) as clash:
        stub.Generate(W.GenerateRequest(request_id="q-waiting"), timeout=10)
    assert clash.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert stub.Cancel(W.CancelRequest(request_id="q-waiting"), timeout=5).was == "queued"
    waiting.finish()
    assert waiting.error.code() == grpc.StatusCode.CANCELLED
    assert stub.Cancel(W.CancelRequest(request_id="q-running"), timeout=5).was == "running"
    running.finish()


def test_deadline_expiring_in_the_queue(runner, stub):
    running = start_stream(stub, "dq-running")
    running.wait_for("progress")
    with runner.frozen():
        with pytest.raises(grpc.RpcError) as caught:
            stub.Generate(W.GenerateRequest(num_inference_steps=2), timeout=1.0)
        assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        status = stub.GetStatus(W.GetStatusRequest(), timeout=5)
        assert (status.queue_depth, status.requests_in_flight) == (0, 1)
        stub.Cancel(W.CancelRequest(request_id="dq-running"), timeout=5)
        running.finish()


def test_sigterm_drains_in_flight_then_exits_zero(runner, tmp_path):
    worker = start_worker(tmp_path, runner.target, "--model", "tiny", "--grace", "60", "--runner-keepalive", "0")
    with grpc.insecure_channel(worker.target) as channel:
        stub = worker_pb2_grpc.WorkerServiceStub(channel)
        stream = start_stream(stub, "drain", steps=40)
        wait_progress(stream, 1)
        with runner.frozen():  # the request is still in flight when the worker drains
            worker.process.send_signal(signal.SIGTERM)
            wait_until(lambda: stub.GetStatus(W.GetStatusRequest(), timeout=5).state == W.WORKER_STATE_DRAINING,
                       30, "DRAINING")
            with pytest.raises(grpc.RpcError) as caught:
                stub.Generate(W.GenerateRequest(num_inference_steps=2), timeout=10)
            assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "draining" in caught.value.details()
        events = stream.finish(120)
        assert stream.error is None and events[-1].HasField("done")
    assert worker.process.wait(60) == 0


def test_sleep_waits_for_the_request_in_flight(runner, stub):
    running = start_stream(stub, "before-sleep", steps=40)
    running.wait_for("progress")
    with runner.frozen():  # both calls arrive while the request runs (on one channel, in order)
        sleep = stub.Sleep.future(W.SleepRequest(level=1), timeout=120)
        late = start_stream(stub, "during-sleep", steps=2)
        late.wait_for("queued")
        assert not sleep.done()
    assert sleep.result().sleeping_components
    assert running.finish()[-1].HasField("done")  # finished before the model went to sleep
    late.finish()
    assert late.error is not None and late.error.code() == grpc.StatusCode.FAILED_PRECONDITION
    stub.WakeUp(W.WakeUpRequest(), timeout=30)
    assert quick(stub).images


def test_cancel_stops_a_real_runner(tiny_pair, tiny_stub):
    """The smoke test on a real runner: Cancel ends the request and the runner stops denoising."""
    stream = start_stream(tiny_stub, "cancel-real")
    wait_progress(stream)
    assert tiny_stub.Cancel(W.CancelRequest(request_id="cancel-real"), timeout=5).was == "running"
    stream.finish()
    assert stream.error is not None and stream.error.code() == grpc.StatusCode.CANCELLED
    assert stopped_after(tiny_pair.runner, "cancel-real") < LONG_STEPS
