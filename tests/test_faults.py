"""Runner failures with real signals, the worker's behaviour against fake runner processes: kill -9
in the middle of a generation (retry on the restarted runner, same bytes), a deadline too short for
a retry (UNAVAILABLE, said why), two runners with one killed under load, and attaching/detaching
runners under load. One smoke test kills a real runner mid-generation."""

from __future__ import annotations

import re
import signal
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2

from diffusion.v1 import worker_pb2, worker_pb2_grpc
from harness.processes import free_port, health_status, start_fake_runner, start_worker, wait_until
from harness.streams import Stream
from support import request, running_pair

pytestmark = pytest.mark.process
W = worker_pb2
READY = "diffusion.v1.WorkerService"
SERVING = health_pb2.HealthCheckResponse.SERVING
STEPS = 150
STEP_S = 0.02  # the fake runners' step: STEPS take 3 s
BATCH_LINE = re.compile(r"batch of \d+ request\(s\) \(\d+ image\(s\)\) on runner (\S+): (.*)$", re.M)


def start_runner_at(log_dir, target: str):
    return start_fake_runner(log_dir, STEP_S, target=target)


def new_target() -> str:
    return f"127.0.0.1:{free_port()}"


def ask(request_id: str, seed: int = 7, steps: int = STEPS) -> W.GenerateRequest:
    return request(request_id=request_id, seed=seed, num_inference_steps=steps)


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    """A worker with one runner on a fixed target, so a new runner can take its place."""
    log_dir = tmp_path_factory.mktemp("faults")
    target = new_target()
    state = {"runner": start_runner_at(log_dir, target), "log_dir": log_dir, "target": target}
    worker = start_worker(log_dir, target)
    state["worker"] = worker
    with grpc.insecure_channel(worker.target) as channel:
        stub = worker_pb2_grpc.WorkerServiceStub(channel)
        started = time.monotonic()
        state["baseline"] = stub.Generate(ask("baseline"), timeout=120).images[0].data
        state["duration"] = time.monotonic() - started
        state["stub"] = stub
        yield state
    worker.stop()
    state["runner"].stop()


def kill_and_restart(state) -> float:
    """kill -9 the runner, check readiness drops, start a new one on the same target."""
    killed = time.monotonic()
    state["runner"].stop(signal.SIGKILL)
    wait_until(lambda: health_status(state["worker"].target, READY, timeout=0.5) != SERVING, 3,
               "readiness NOT_SERVING")
    not_ready_after = time.monotonic() - killed
    state["runner"] = start_runner_at(state["log_dir"], state["target"])
    return not_ready_after


def test_kill_9_mid_generation_retries_on_the_restarted_runner_with_same_bytes(single):
    stub = single["stub"]
    stream = Stream(stub, ask("killed-once"))
    stream.wait_step(20)
    queued = stub.Generate.future(ask("queued-behind", seed=8, steps=3), timeout=120)
    wait_until(lambda: stub.GetStatus(W.GetStatusRequest(), timeout=5).queue_depth == 1, 10, "queued")
    not_ready_after = kill_and_restart(single)
    print(f"readiness NOT_SERVING {not_ready_after * 1000:.0f} ms after kill -9")
    assert not_ready_after < 1.5
    stream.join(120)
    assert stream.error is None, stream.error
    assert stream.done.images[0].data == single["baseline"]  # bit-identical to the undisturbed run
    assert queued.result().images  # the queued request waited for the new runner
    kinds = stream.kinds
    # The retry shows in the stream: queued and started again, then progress from step 1.
    assert kinds.count("started") == 2
    second = kinds.index("started", kinds.index("started") + 1)
    assert kinds[second - 1] == "queued"
    assert stream.events[second + 1].progress.step == 1
    assert [e.progress.step for e in stream.events[second + 1:-1]] == list(range(1, STEPS + 1))
    status = stub.GetStatus(W.GetStatusRequest(), timeout=5)
    assert status.state == W.WORKER_STATE_READY and status.runners[0].restarts == 1
    assert status.runners[0].ready
    assert "retrying 1 of 1 request(s)" in single["worker"].log()


def test_deadline_too_short_for_a_retry_is_unavailable_and_says_why(single):
    stub = single["stub"]
    # Three times the usual steps: a third of the run is left when the runner dies, too little for a
    # whole retry, yet seconds more than the worker needs to notice, on a fast machine as on a slow one.
    steps = 3 * STEPS
    timeout = 1.3 * 3 * single["duration"]
    stream = Stream(stub, ask("short-deadline", steps=steps), timeout=timeout)
    stream.wait_step(steps * 2 // 3)
    kill_and_restart(single)
    stream.join(120)
    assert stream.error is not None and stream.error.code() == grpc.StatusCode.UNAVAILABLE, stream.error
    details = stream.error.details()
    print(f"deadline {timeout:.2f} s: {details}")
    assert "failed after" in details and "not retried" in details and "deadline" in details
    wait_until(lambda: health_status(single["worker"].target, READY) == SERVING, 60, "ready again")
    assert stub.Generate(ask("after", steps=STEPS), timeout=120).images[0].data == single["baseline"]
    assert stub.GetStatus(W.GetStatusRequest(), timeout=5).runners[0].restarts == 2


def test_no_runner_coming_back_ends_waiting_requests(tmp_path):
    target = new_target()
    runner = start_runner_at(tmp_path, target)
    worker = start_worker(tmp_path, target, "--max-runner-wait", "1.5")
    try:
        with grpc.insecure_channel(worker.target) as channel:
            stub = worker_pb2_grpc.WorkerServiceStub(channel)
            stream = Stream(stub, ask("orphan", steps=100), timeout=None)
            stream.wait_step(10)
            runner.stop(signal.SIGKILL)
            stream.join(30)
            assert stream.error is not None and stream.error.code() == grpc.StatusCode.UNAVAILABLE
            assert "no runner was ready for 1.5 s" in stream.error.details(), stream.error.details()
            with pytest.raises(grpc.RpcError) as caught:
                stub.Generate(ask("late", steps=2), timeout=10)
            assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
            assert stub.GetStatus(W.GetStatusRequest(), timeout=5).state == W.WORKER_STATE_STARTING
    finally:
        worker.stop()
        runner.stop()


def test_two_runners_one_killed_under_load_every_request_completes(tmp_path):
    targets = [new_target(), new_target()]
    runners = [start_runner_at(tmp_path, t) for t in targets]
    worker = start_worker(tmp_path, targets[0], "--runner", targets[1], "--max-batch-size", "2")
    try:
        with grpc.insecure_channel(worker.target) as channel:
            stub = worker_pb2_grpc.WorkerServiceStub(channel)
            # Ready once one runner is; the other may still be loading the model.
            wait_until(lambda: all(r.ready for r in stub.GetStatus(W.GetStatusRequest(), timeout=5).runners),
                       60, "both runners ready")
            futures = [stub.Generate.future(ask(f"load-{i}", seed=i, steps=100), timeout=120) for i in range(6)]
            wait_until(lambda: all(r.requests_in_flight for r in stub.GetStatus(
                W.GetStatusRequest(), timeout=5).runners), 30, "work on both runners", interval=0.02)
            runners[0].stop(signal.SIGKILL)
            results = [f.result() for f in futures]  # raises if any failed
            assert all(r.images for r in results)
            # Still ready on the other runner.
            assert health_status(worker.target, READY) == SERVING
            status = stub.GetStatus(W.GetStatusRequest(), timeout=5)
            assert [r.ready for r in status.runners] == [False, True]
        log = worker.log()
        assert re.search(r"runner \S+ failed after \d+ of 100 steps .*retrying [12] of [12]", log), log
    finally:
        worker.stop()
        for runner in runners:
            runner.stop()


class Load:
    """Client threads sending Generate in a loop until stopped; every outcome is kept."""

    def __init__(self, stub, clients: int = 3, steps: int = 6) -> None:
        self.stub, self.steps = stub, steps
        self.outcomes: list[tuple[str, str]] = []
        self._stop = threading.Event()
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(clients)]
        for thread in self.threads:
            thread.start()

    def _run(self, client: int) -> None:
        n = 0
        while not self._stop.is_set():
            n += 1
            try:
                self.stub.Generate(ask(f"l{client}-{n}", seed=n, steps=self.steps), timeout=60)
                self.outcomes.append(("OK", ""))
            except grpc.RpcError as error:
                self.outcomes.append((error.code().name, error.details()))
            except ValueError:  # the channel closed: the test is over
                return

    def stop(self) -> list[tuple[str, str]]:
        self._stop.set()
        for thread in self.threads:
            thread.join(90)
            assert not thread.is_alive()
        return self.outcomes


def test_attach_and_detach_under_load(tmp_path):
    first, second = new_target(), new_target()
    runner_a = start_runner_at(tmp_path, first)
    runner_b = None
    worker = start_worker(tmp_path, first, "--model", "tiny", "--max-batch-size", "2")
    try:
        with grpc.insecure_channel(worker.target) as channel:
            stub = worker_pb2_grpc.WorkerServiceStub(channel)
            runner_b = start_runner_at(tmp_path, second)
            load = Load(stub)
            wait_for_batches(worker, 1, "work on the first runner")
            attached = stub.AttachRunner(W.AttachRunnerRequest(target=second), timeout=90).runner
            assert attached.ready and attached.info.model.source == "tiny"
            wait_until(lambda: any(r[0] == second for r in runs(worker)), 30, "work on the attached runner")
            stub.DetachRunner(W.DetachRunnerRequest(target=first, drain=True), timeout=60)
            assert [r.target for r in stub.GetStatus(W.GetStatusRequest(), timeout=5).runners] == [second]
            wait_for_batches(worker, 2, "work after the drained detach")
            # Back again, then the other one leaves without draining: its batch is re-queued.
            stub.AttachRunner(W.AttachRunnerRequest(target=first), timeout=90)
            wait_until(lambda: runs(worker)[-1][0] == first, 30, "work on the re-attached runner")
            stub.DetachRunner(W.DetachRunnerRequest(target=second, drain=False), timeout=60)
            wait_for_batches(worker, 2, "work after the detach without draining")
            outcomes = load.stop()
            with pytest.raises(grpc.RpcError) as caught:
                stub.DetachRunner(W.DetachRunnerRequest(target=second), timeout=10)
            assert caught.value.code() == grpc.StatusCode.NOT_FOUND
        codes = [code for code, _ in outcomes]
        print(f"attach/detach under load: {len(codes)} requests, {codes.count('OK')} OK")
        assert codes and set(codes) == {"OK"}, [o for o in outcomes if o[0] != "OK"]
        log = worker.log().splitlines()

        def index(pattern: str, start: int = 0) -> int:
            return next(i for i, line in enumerate(log) if i >= start and re.search(pattern, line))

        # The attached runner got work only once it held the model ...
        applying_b = index(rf"runner {re.escape(second)} \(instance \w+\): applying model tiny")
        ready_b = index(rf"runner {re.escape(second)} ready \(instance", applying_b)
        batches = [(i, m.group(1)) for i, line in enumerate(log) if (m := BATCH_LINE.search(line))]
        assert min(i for i, t in batches if t == second) > ready_b
        # ... and a detached runner got no work after the detach, until it was attached again.
        detached_a = index(rf"detaching runner {re.escape(first)}")
        reattached_a = index(rf"runner {re.escape(first)} ready \(instance", detached_a)
        assert not [i for i, t in batches if t == first and detached_a < i < reattached_a]
        detached_b = index(rf"detaching runner {re.escape(second)}")
        assert not [i for i, t in batches if t == second and i > detached_b]
    finally:
        worker.stop()
        runner_a.stop()
        if runner_b is not None:
            runner_b.stop()


def runs(worker) -> list[tuple[str, list[str]]]:
    return [(m.group(1), m.group(2).split()) for m in BATCH_LINE.finditer(worker.log())]


def wait_for_batches(worker, count: int, what: str) -> None:
    """Waits until the worker has logged ``count`` more batches than it has now: the load went on."""
    seen = len(runs(worker))
    wait_until(lambda: len(runs(worker)) >= seen + count, 30, what)


@pytest.mark.slow
def test_kill_9_of_a_real_runner_mid_generation_retries_with_same_bytes(tmp_path):
    """The smoke test on a real runner (request-level batching: a retry runs in the batch it ran in,
    so its bytes are the same; step-level batching keeps an image within 1/255 of it in another)."""
    with running_pair(tmp_path, runner_args=("--threads", "1", "--batching", "request")) as pair:
        with grpc.insecure_channel(pair.worker.target) as channel:
            stub = worker_pb2_grpc.WorkerServiceStub(channel)
            baseline = stub.Generate(ask("real-baseline", steps=40), timeout=120).images[0].data
            stream = Stream(stub, ask("real-killed", steps=40))
            stream.wait_step(5)
            pair.restart_runner(signal.SIGKILL)
            stream.join(120)
            assert stream.error is None, stream.error
            assert stream.done.images[0].data == baseline
            assert stream.kinds.count("started") == 2
            assert stub.GetStatus(W.GetStatusRequest(), timeout=5).runners[0].restarts == 1
