"""Cancellation, deadlines, the bounded queue and draining on SIGTERM, against a real runner."""

from __future__ import annotations

import signal
import time

import grpc
import pytest

from diffusion.v1 import worker_pb2, worker_pb2_grpc
from harness.processes import start_runner, start_worker, worker_stub
from harness.streams import Stream

W = worker_pb2
LONG_STEPS = 200


@pytest.fixture(scope="module")
def runner(tmp_path_factory):
    runner = start_runner(tmp_path_factory.mktemp("queue-runner"))
    yield runner
    runner.stop()


@pytest.fixture(scope="module")
def worker(runner, tmp_path_factory):
    worker = start_worker(tmp_path_factory.mktemp("queue-worker"), runner.target, "--max-queue", "1",
                          "--max-batch-size", "1")  # one request runs at a time: the rest queue
    yield worker
    worker.stop()


@pytest.fixture(scope="module")
def stub(worker):
    with worker_stub(worker.target) as stub:
        yield stub


def start_stream(stub, request_id: str, steps: int = LONG_STEPS) -> Stream:
    return Stream(stub, W.GenerateRequest(request_id=request_id, num_inference_steps=steps, seed=1))


def wait_progress(stream: Stream, steps: int = 3) -> None:
    for _ in range(steps):
        stream.wait_for("progress")


def quick(stub) -> W.GenerateResponse:
    return stub.Generate(W.GenerateRequest(num_inference_steps=2, seed=2), timeout=60)


def test_cancel_stops_a_running_request_within_a_few_steps(stub):
    stream = start_stream(stub, "cancel-running")
    wait_progress(stream)
    step = stream.step_time()
    cancelled_at = time.monotonic()
    assert stub.Cancel(W.CancelRequest(request_id="cancel-running"), timeout=5).was == "running"
    stream.finish()
    assert stream.error is not None and stream.error.code() == grpc.StatusCode.CANCELLED
    assert "cancelled by Cancel" in stream.error.details()
    assert len(stream.progress_times) < 20
    started = time.monotonic()
    assert quick(stub).images
    # The runner stopped denoising: the next request did not wait for the rest of the 200 steps.
    assert time.monotonic() - cancelled_at < max(5.0, 0.3 * LONG_STEPS * step)
    assert time.monotonic() - started < max(5.0, 0.3 * LONG_STEPS * step)


def test_client_deadline_stops_the_runner(stub):
    started = time.monotonic()
    with pytest.raises(grpc.RpcError) as caught:
        stub.Generate(W.GenerateRequest(num_inference_steps=LONG_STEPS), timeout=1.5)
    assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    probe = start_stream(stub, "after-deadline", steps=3)
    assert probe.finish()[-1].HasField("done")
    step = probe.step_time()
    assert time.monotonic() - started < max(8.0, 0.5 * LONG_STEPS * step)


def test_client_cancel_stops_the_runner(stub):
    stream = start_stream(stub, "client-cancel")
    wait_progress(stream)
    step = stream.step_time()
    stream.call.cancel()
    stream.finish()
    started = time.monotonic()
    assert quick(stub).images
    assert time.monotonic() - started < max(5.0, 0.3 * LONG_STEPS * step)


def test_full_queue_is_resource_exhausted_and_positions_move(stub):
    running = start_stream(stub, "q-running")
    running.wait_for("started")
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
    assert quick(stub).images


def test_deadline_expiring_in_the_queue(stub):
    running = start_stream(stub, "dq-running")
    running.wait_for("started")
    with pytest.raises(grpc.RpcError) as caught:
        stub.Generate(W.GenerateRequest(num_inference_steps=2), timeout=1.0)
    assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    status = stub.GetStatus(W.GetStatusRequest(), timeout=5)
    assert (status.queue_depth, status.requests_in_flight) == (0, 1)
    stub.Cancel(W.CancelRequest(request_id="dq-running"), timeout=5)
    running.finish()


def test_sigterm_drains_in_flight_then_exits_zero(runner, tmp_path):
    worker = start_worker(tmp_path, runner.target, "--grace", "60")
    with grpc.insecure_channel(worker.target) as channel:
        stub = worker_pb2_grpc.WorkerServiceStub(channel)
        stream = start_stream(stub, "drain", steps=30)
        wait_progress(stream, 1)
        worker.process.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        with pytest.raises(grpc.RpcError) as caught:
            stub.Generate(W.GenerateRequest(num_inference_steps=2), timeout=10)
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "draining" in caught.value.details()
        events = stream.finish(120)
        assert stream.error is None and events[-1].HasField("done")
    assert worker.process.wait(60) == 0


def test_sleep_waits_for_the_request_in_flight(stub):
    running = start_stream(stub, "before-sleep", steps=40)
    running.wait_for("started")
    sleep = stub.Sleep.future(W.SleepRequest(level=1), timeout=120)
    time.sleep(0.2)
    assert not sleep.done()
    late = start_stream(stub, "during-sleep", steps=2)
    assert sleep.result().sleeping_components
    assert running.finish()[-1].HasField("done")  # finished before the model went to sleep
    late.finish()
    assert late.error is not None and late.error.code() == grpc.StatusCode.FAILED_PRECONDITION
    stub.WakeUp(W.WakeUpRequest(), timeout=30)
    assert quick(stub).images
