"""Generate requests are received only once one of ``--max-receiving-requests`` slots is free
(issue 20 item 5): a call waiting for a slot leaves its bytes at the client, health and the other
RPCs never wait, and ``--receive-timeout`` frees a slot a silent sender holds.

A slot is held by a raw stream-unary call on Generate's path whose request iterator blocks on an
event: on the wire, a unary call that has not sent its message yet.
"""

from __future__ import annotations

import threading
import urllib.request
from collections.abc import Iterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from diffusion.v1 import worker_pb2, worker_pb2_grpc
from harness.processes import free_port, start_fake_runner, start_worker, wait_until
from serving_common.protocol import WORKER_SERVICE
from support import request

W = worker_pb2
REQUEST = request(prompt="a gate", num_inference_steps=2, seed=3)
pytestmark = [pytest.mark.timeout(300), pytest.mark.process]


@pytest.fixture(scope="module")
def runner(tmp_path_factory):
    """The fake runner process: the receive gate is the worker's alone."""
    process = start_fake_runner(tmp_path_factory.mktemp("gate-runner"))
    yield process
    process.stop()


def gated_worker(runner, log_dir, receive_timeout: float, *args: str):
    port = free_port()
    worker = start_worker(log_dir, runner.target, "--max-receiving-requests", "1", "--receive-timeout",
                          str(receive_timeout), "--metrics-port", str(port), *args)
    worker.extra["metrics"] = f"http://127.0.0.1:{port}/metrics"
    return worker


def gauge(worker, name: str) -> float:
    with urllib.request.urlopen(worker.extra["metrics"], timeout=10) as response:
        for line in response.read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
    raise AssertionError(f"no {name}")


class SlotHolder:
    """A Generate call that takes the only receive slot and sends its request once ``send()``."""

    def __init__(self, channel: grpc.Channel) -> None:
        self._send = threading.Event()
        method = channel.stream_unary(f"/{WORKER_SERVICE}/Generate",
                                      request_serializer=W.GenerateRequest.SerializeToString,
                                      response_deserializer=W.GenerateResponse.FromString)
        self.call = method.future(self._requests(), timeout=120)

    def _requests(self) -> Iterator[W.GenerateRequest]:
        self._send.wait()
        yield REQUEST

    def send(self) -> None:
        self._send.set()


@pytest.fixture(scope="module")
def worker(runner, tmp_path_factory):
    """A worker with one receive slot, a receive timeout no test waits for, and no room for image inputs."""
    process = gated_worker(runner, tmp_path_factory.mktemp("gate"), 600, "--max-input-bytes", "1")
    yield process
    process.stop()


@pytest.fixture(scope="module")
def channel(worker):
    with grpc.insecure_channel(worker.target) as opened:
        worker_pb2_grpc.WorkerServiceStub(opened).Generate(W.GenerateRequest(num_inference_steps=1), timeout=120)
        yield opened


def test_a_generate_waits_for_the_receive_slot_while_health_and_status_answer(worker, channel):
    stub = worker_pb2_grpc.WorkerServiceStub(channel)
    generations = stub.GetStatus(W.GetStatusRequest(), timeout=10).statistics.generations
    holder = SlotHolder(channel)
    try:
        wait_until(lambda: gauge(worker, "diffusion_requests_receiving") == 1, 60, "the slot held")
        waiting = stub.Generate.future(REQUEST, timeout=120)
        stream = stub.GenerateStream(W.GenerateStreamRequest(request=REQUEST), timeout=120)
        wait_until(lambda: gauge(worker, "diffusion_requests_waiting_to_receive") == 2, 60, "two calls waiting")
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=WORKER_SERVICE),
                                                           timeout=10)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        assert stub.GetStatus(W.GetStatusRequest(), timeout=10).state == W.WORKER_STATE_READY
        assert not waiting.done()
        holder.send()
        assert holder.call.result(timeout=120).images
        assert waiting.result(timeout=120).images
        assert [event.WhichOneof("event") for event in stream][-1] == "done"
    finally:
        holder.send()
    wait_until(lambda: gauge(worker, "diffusion_requests_receiving") == 0, 60, "the slot free")
    # the interceptor still records generations from the request it now reads from a stream
    assert stub.GetStatus(W.GetStatusRequest(), timeout=10).statistics.generations == generations + 3


def test_a_call_with_two_request_messages_is_refused_and_the_worker_goes_on(channel):
    method = channel.stream_unary(f"/{WORKER_SERVICE}/Generate", request_serializer=W.GenerateRequest.SerializeToString,
                                  response_deserializer=W.GenerateResponse.FromString)
    with pytest.raises(grpc.RpcError) as refused:
        method(iter([REQUEST, REQUEST]), timeout=60)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "one request message" in refused.value.details()
    assert worker_pb2_grpc.WorkerServiceStub(channel).Generate(REQUEST, timeout=120).images


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        return next(int(line.split()[1]) / 1024 for line in status if line.startswith("VmRSS:"))


def test_refused_large_requests_do_not_stay_in_memory(worker, channel):
    """A refused call's request is held by a reference cycle (gRPC's abort exception, its frames,
    the call's state) until a collection: 20 refused 12.6 MB requests held about 500 MB without one."""
    stub = worker_pb2_grpc.WorkerServiceStub(channel)
    before = rss_mb(worker.pid)
    large = W.GenerateRequest(prompt="large", image=bytes(12_600_000), width=64, height=64, num_inference_steps=2)
    for _ in range(20):
        with pytest.raises(grpc.RpcError) as refused:
            stub.Generate(large, timeout=120)
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED  # --max-input-bytes 1
    wait_until(lambda: rss_mb(worker.pid) < before + 100, 60, f"the worker's RSS back near {before:.0f} MB")


def test_the_receive_timeout_frees_the_slot_of_a_silent_sender(runner, tmp_path):
    worker = gated_worker(runner, tmp_path, receive_timeout=1)
    holder = None
    try:
        with grpc.insecure_channel(worker.target) as channel:
            holder = SlotHolder(channel)  # never sends while the test lasts
            wait_until(lambda: gauge(worker, "diffusion_requests_receiving") == 1, 60, "the slot held")
            assert worker_pb2_grpc.WorkerServiceStub(channel).Generate(REQUEST, timeout=120).images
            error = holder.call.exception(timeout=120)
            assert error is not None and error.code() == grpc.StatusCode.DEADLINE_EXCEEDED, error
            assert "--receive-timeout" in error.details()
    finally:
        if holder is not None:
            holder.send()
        worker.stop()
