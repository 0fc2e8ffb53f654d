"""Request-level dynamic batching, the worker's policy against the fake runner process: compatible
requests share one Execute, each gets its own seed's image, cancelling one request of a batch leaves
the others alone, and the head of the queue is never overtaken by a batch it is not in. One smoke
test runs batched requests on a real runner.

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
from harness.processes import start_worker, wait_until
from harness.streams import Stream
from support import pixels, request

pytestmark = pytest.mark.process
W = worker_pb2
STEPS = 8
BATCH_LINE = re.compile(r"batch of \d+ request\(s\) \(\d+ image\(s\)\) on runner (\S+): (.*)$", re.M)


@pytest.fixture(scope="module")
def pair(serve):
    return serve("--max-batch-size", "4", "--max-batch-delay-ms", "200",
                 "--runner-keepalive", "0",  # a frozen runner is not a lost one
                 fake_step_s=0.05)


def ask(request_id: str, seed: int, steps: int = STEPS, size: int = 64) -> W.GenerateRequest:
    return request(request_id=request_id, prompt="a lantern", seed=seed, num_inference_steps=steps,
                   width=size, height=size)


def batches(worker) -> list[list[str]]:
    """The request ids of each batch the worker started, in order, from its log."""
    return [m.group(2).split() for m in BATCH_LINE.finditer(worker.log())]


@contextlib.contextmanager
def held(pair, stub, request_id: str) -> Iterator[None]:
    """A long request runs on the frozen runner for the block: what is sent meanwhile queues behind
    it. At the end it is cancelled, and the queue is dispatched at once."""
    blocker = Stream(stub, ask(request_id, 1, steps=500))
    blocker.wait_for("progress")
    with pair.runner.frozen():
        yield
        assert stub.Cancel(W.CancelRequest(request_id=request_id), timeout=5).was == "running"
        blocker.join(30)


def wait_queued(stub, depth: int) -> None:
    wait_until(lambda: stub.GetStatus(W.GetStatusRequest(), timeout=5).queue_depth == depth, 30, f"{depth} queued")


def alone(stub, request_id: str, seed: int, steps: int = STEPS) -> np.ndarray:
    return pixels(stub.Generate(ask(request_id, seed, steps), timeout=60))


def test_compatible_requests_share_one_execute_and_match_alone(pair, stub):
    worker = pair.worker
    seeds = [10, 11, 12, 13]
    with held(pair, stub, "b4-block"):
        futures = [stub.Generate.future(ask(f"b4-{s}", s), timeout=60) for s in seeds]
        wait_queued(stub, 4)
    responses = [f.result() for f in futures]
    # One runner Execute: the worker logged one batch of the four, and they share its timing.
    assert sorted(f"b4-{s}" for s in seeds) in [sorted(b) for b in batches(worker)], batches(worker)
    assert len({r.timings.execute_ms for r in responses}) == 1
    # Each request got the image of its own seed, the one it gets alone.
    for seed, response in zip(seeds, responses, strict=True):
        assert response.images[0].seed == seed
        assert np.array_equal(pixels(response), alone(stub, f"alone-{seed}", seed))


def test_cancelling_one_request_of_a_batch_leaves_the_others(pair, stub):
    worker = pair.worker
    steps = 60  # 3 s on the fake runner: still running when it is frozen for the cancel
    with held(pair, stub, "c3-block"):
        streams = {s: Stream(stub, ask(f"c3-{s}", s, steps)) for s in (21, 22, 23)}
        wait_queued(stub, 3)
    for stream in streams.values():
        stream.wait_for("progress")
    assert sorted(f"c3-{s}" for s in streams) in [sorted(b) for b in batches(worker)], batches(worker)
    with pair.runner.frozen():  # the batch is still running when one of its requests is cancelled
        assert stub.Cancel(W.CancelRequest(request_id="c3-22"), timeout=5).was == "running"
    for stream in streams.values():
        stream.join(90)
    assert streams[22].error is not None and streams[22].error.code() == grpc.StatusCode.CANCELLED
    for seed in (21, 23):
        stream = streams[seed]
        assert stream.error is None and stream.done is not None, stream.error
        # Progress ran to the end for the requests still wanted, and each got its own seed's image
        # (the fake runner's image depends on the seed and the weights, not the steps).
        assert stream.kinds.count("progress") == steps
        assert np.array_equal(pixels(stream.done), alone(stub, f"c3-alone-{seed}", seed, 2))


def test_head_of_queue_is_never_overtaken(pair, stub):
    """Behind a long request, A (64px), B (32px), C (64px) queue up: the next batch is A+C (the head
    and what fits with it), then B; B is not starved and A was not held back for B."""
    worker = pair.worker
    with held(pair, stub, "h-block"):
        a = stub.Generate.future(ask("h-a", 2), timeout=60)
        wait_queued(stub, 1)
        b = stub.Generate.future(ask("h-b", 3, size=32), timeout=60)
        wait_queued(stub, 2)
        c = stub.Generate.future(ask("h-c", 4), timeout=60)
        wait_queued(stub, 3)
    for future in (a, b, c):
        assert future.result().images
    order = [b for b in batches(worker) if any(i.startswith("h-") for i in b)]
    assert order == [["h-block"], ["h-a", "h-c"], ["h-b"]], order


def test_batch_size_one_disables_batching(pair, tmp_path):
    runner = pair.runner
    worker = start_worker(tmp_path, runner.target, "--model", "tiny", "--max-batch-size", "1")
    try:
        with grpc.insecure_channel(worker.target) as channel:
            stub = worker_pb2_grpc.WorkerServiceStub(channel)
            futures = [stub.Generate.future(ask(f"one-{s}", s, steps=2), timeout=60) for s in (1, 2, 3)]
            for future in futures:
                assert future.result().images
        assert all(len(b) == 1 for b in batches(worker)), batches(worker)
    finally:
        worker.stop()


def test_batched_requests_on_a_real_runner_match_alone(tiny_stub):
    """The smoke test on a real runner (the worker's default batching): requests sent together are
    batched, and each image is within 2/255 of the one its seed gives alone (batched kernels may
    round differently)."""
    seeds = [31, 32, 33]
    futures = [tiny_stub.Generate.future(ask(f"real-{s}", s, steps=2), timeout=120) for s in seeds]
    together = [pixels(f.result()).astype(int) for f in futures]
    for seed, image in zip(seeds, together, strict=True):
        reference = pixels(tiny_stub.Generate(ask(f"real-alone-{seed}", seed, steps=2), timeout=120)).astype(int)
        assert int(np.abs(image - reference).max()) <= 2, seed
