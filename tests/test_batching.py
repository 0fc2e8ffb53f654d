"""Request-level dynamic batching against a real runner: compatible requests share one Execute, each image is the
one its seed gives alone, cancelling one request of a batch leaves the others alone, and the head
of the queue is never overtaken by a batch it is not in.

Requests meant to share a batch are queued behind a blocker held on a frozen runner (SIGSTOP), so
they are all queued when it goes, however fast or slow the machine."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator

import grpc
import numpy as np
import pytest

from diffusion.v1 import worker_pb2, worker_pb2_grpc
from harness.processes import start_runner, start_worker, wait_until, worker_stub
from harness.streams import Stream

W = worker_pb2
STEPS = 8
BATCH_LINE = re.compile(r"batch of \d+ request\(s\) \(\d+ image\(s\)\) on runner (\S+): (.*)$", re.M)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("batching")
    runner = start_runner(log_dir, "--batching", "request")  # step-level batching: test_step_batching
    worker = start_worker(log_dir, runner.target, "--max-batch-size", "4", "--max-batch-delay-ms", "200",
                          "--runner-keepalive", "0")  # a frozen runner is not a lost one
    yield runner, worker
    worker.stop()
    runner.stop()


@pytest.fixture(scope="module")
def stub(pair):
    with worker_stub(pair[1].target) as stub:
        yield stub


def request(request_id: str, seed: int, steps: int = STEPS, size: int = 64) -> W.GenerateRequest:
    return W.GenerateRequest(request_id=request_id, prompt="a lantern", seed=seed, num_inference_steps=steps,
                             width=size, height=size, output_format=W.OUTPUT_FORMAT_RAW)


def pixels(response: W.GenerateResponse) -> np.ndarray:
    image = response.images[0]
    return np.frombuffer(image.data, dtype=np.uint8).reshape(image.height, image.width, 3).astype(int)


def batches(worker) -> list[list[str]]:
    """The request ids of each batch the worker started, in order, from its log."""
    return [m.group(2).split() for m in BATCH_LINE.finditer(worker.log())]


@contextlib.contextmanager
def held(pair, stub, request_id: str) -> Iterator[None]:
    """A long request runs on the frozen runner for the block: what is sent meanwhile queues behind
    it. At the end it is cancelled, and the queue is dispatched at once."""
    blocker = Stream(stub, request(request_id, 1, steps=500))
    blocker.wait_for("progress")
    with pair[0].frozen():
        yield
        assert stub.Cancel(W.CancelRequest(request_id=request_id), timeout=5).was == "running"
        blocker.join(30)


def wait_queued(stub, depth: int) -> None:
    wait_until(lambda: stub.GetStatus(W.GetStatusRequest(), timeout=5).queue_depth == depth, 30, f"{depth} queued")


def alone(stub, request_id: str, seed: int, steps: int = STEPS) -> np.ndarray:
    return pixels(stub.Generate(request(request_id, seed, steps), timeout=60))


def test_compatible_requests_share_one_execute_and_match_alone(pair, stub):
    worker = pair[1]
    seeds = [10, 11, 12, 13]
    with held(pair, stub, "b4-block"):
        futures = [stub.Generate.future(request(f"b4-{s}", s), timeout=60) for s in seeds]
        wait_queued(stub, 4)
    responses = [f.result() for f in futures]
    # One runner Execute: the worker logged one batch of the four, and they share its timing.
    assert sorted(f"b4-{s}" for s in seeds) in [sorted(b) for b in batches(worker)], batches(worker)
    assert len({r.timings.execute_ms for r in responses}) == 1
    # Each image is the one its seed gives alone.
    worst = 0
    for seed, response in zip(seeds, responses, strict=True):
        assert response.images[0].seed == seed
        reference = alone(stub, f"alone-{seed}", seed)
        worst = max(worst, int(np.abs(pixels(response) - reference).max()))
    print(f"batch of 4 vs alone: max pixel difference {worst}")
    assert worst <= 2


def test_cancelling_one_request_of_a_batch_leaves_the_others(pair, stub):
    worker = pair[1]
    steps = STEPS  # the cancel comes with the runner frozen mid-batch: no need for a long one
    with held(pair, stub, "c3-block"):
        streams = {s: Stream(stub, request(f"c3-{s}", s, steps)) for s in (21, 22, 23)}
        wait_queued(stub, 3)
    for stream in streams.values():
        stream.wait_for("progress")
    assert sorted(f"c3-{s}" for s in streams) in [sorted(b) for b in batches(worker)], batches(worker)
    with pair[0].frozen():  # the batch is still running when one of its requests is cancelled
        assert stub.Cancel(W.CancelRequest(request_id="c3-22"), timeout=5).was == "running"
    for stream in streams.values():
        stream.join(90)
    assert streams[22].error is not None and streams[22].error.code() == grpc.StatusCode.CANCELLED
    worst = 0
    for seed in (21, 23):
        stream = streams[seed]
        assert stream.error is None and stream.done is not None, stream.error
        # Progress ran to the end for the requests still wanted.
        assert stream.kinds.count("progress") == steps
        done = stream.done
        reference = alone(stub, f"c3-alone-{seed}", seed, steps)
        worst = max(worst, int(np.abs(pixels(done) - reference).max()))
    print(f"batch of 3 with one cancelled vs alone: max pixel difference {worst}")
    assert worst <= 2


def test_head_of_queue_is_never_overtaken(pair, stub):
    """Behind a long request, A (64px), B (32px), C (64px) queue up: the next batch is A+C (the head
    and what fits with it), then B; B is not starved and A was not held back for B."""
    worker = pair[1]
    with held(pair, stub, "h-block"):
        a = stub.Generate.future(request("h-a", 2), timeout=60)
        wait_queued(stub, 1)
        b = stub.Generate.future(request("h-b", 3, size=32), timeout=60)
        wait_queued(stub, 2)
        c = stub.Generate.future(request("h-c", 4), timeout=60)
        wait_queued(stub, 3)
    for future in (a, b, c):
        assert future.result().images
    order = [b for b in batches(worker) if any(i.startswith("h-") for i in b)]
    assert order == [["h-block"], ["h-a", "h-c"], ["h-b"]], order


def test_batch_size_one_disables_batching(pair, tmp_path):
    runner = pair[0]
    worker = start_worker(tmp_path, runner.target, "--max-batch-size", "1")
    try:
        with grpc.insecure_channel(worker.target) as channel:
            stub = worker_pb2_grpc.WorkerServiceStub(channel)
            futures = [stub.Generate.future(request(f"one-{s}", s, steps=2), timeout=60) for s in (1, 2, 3)]
            for future in futures:
                assert future.result().images
        assert all(len(b) == 1 for b in batches(worker)), batches(worker)
    finally:
        worker.stop()
