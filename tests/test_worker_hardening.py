"""Hostile cases: a hung runner, a late lifecycle operation, state changed behind the worker's back,
a worker restart, a changed weights file, and bad input (issue 10). What is the worker's alone runs
against the fake runner process; what needs a real runner's device or model, against one."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2

from diffusion.v1 import runner_pb2, worker_pb2
from harness.processes import REPO, free_port, health_status, start_worker, wait_until, worker_stub
from harness.streams import Stream
from runner_calls import info, item, perturbed_weights, runner_stub, tiny_model_copy
from serving_common.errors import field_violations
from serving_common.protocol import WORKER_SERVICE
from support import REQUEST, Pair

pytestmark = pytest.mark.process
W = worker_pb2
SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


@pytest.mark.parametrize(("flags", "named"), [
    (("--cache", "first_block_cache", "--cache-threshold", "inf"), "--cache-threshold"),
    (("--cache-threshold", "0.1"), "--cache"),
    (("--cache", "nope", "--cache-threshold", "0.1"), "--cache"),
    (("--attention-backend", "../x"), "--attention-backend"),
    (("--quantization", "int4"), "--quantization"),
])
def test_model_flags_init_would_refuse_stop_the_worker_at_start(flags, named):
    """The rule Init applies (serving_common.input_rules.acceleration_violations), before any runner is
    reached: no runner listens at --runner, and a worker that started would wait for one."""
    done = subprocess.run([sys.executable, "-m", "worker_service.main", "--listen", f"127.0.0.1:{free_port()}",
                           "--runner", f"127.0.0.1:{free_port()}", "--model", "shapes", *flags], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and f"argument {named}: " in done.stderr, done.stderr


def status(stub) -> W.GetStatusResponse:
    return stub.GetStatus(W.GetStatusRequest(), timeout=5)


def test_a_hung_runner_is_noticed_its_requests_end_and_it_comes_back(fake_pair):
    # Noticed by the keepalive (1 s, then 5 s for the answer).
    pair = fake_pair("--runner-keepalive", "1", "--runner-stall-timeout", "60", "--max-runner-wait", "3",
                     fake_step_s=0.05)
    runner, worker = pair.runner, pair.worker
    try:
        with worker_stub(worker.target, warm=False) as stub:
            # No deadline: however slow its steps were, it is retried, then ends for want of a runner.
            stream = Stream(stub, W.GenerateRequest(prompt="stuck", num_inference_steps=200, seed=1), timeout=None)
            stream.wait_step(2)
            runner.process.send_signal(signal.SIGSTOP)
            stopped = time.monotonic()
            wait_until(lambda: health_status(worker.target, WORKER_SERVICE, 1) == NOT_SERVING, 15, "NOT_SERVING")
            not_ready_after = time.monotonic() - stopped
            stream.join(30)  # no deadline on the call: it still ends
            assert stream.error is not None and stream.error.code() == grpc.StatusCode.UNAVAILABLE, stream.error
            assert "no runner" in stream.error.details(), stream.error.details()
            with pytest.raises(grpc.RpcError) as refused:
                stub.Generate(REQUEST)  # no deadline either
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
            print(f"hung runner: NOT_SERVING after {not_ready_after:.1f} s, stream ended after "
                  f"{stream.ended_at - stopped:.1f} s: {stream.error.details()}")
            runner.process.send_signal(signal.SIGCONT)
            wait_until(lambda: health_status(worker.target, WORKER_SERVICE, 1) == SERVING, 30, "SERVING again")
            assert stub.Generate(REQUEST, timeout=60).images
    finally:
        runner.process.send_signal(signal.SIGCONT)


def test_state_changed_behind_the_workers_back_is_undone(fake_pair):
    pair = fake_pair("--runner-poll-interval", "0.3")
    with worker_stub(pair.worker.target) as stub:
        baseline = stub.Generate(REQUEST, timeout=60).images[0].data
        direct = runner_stub(pair.runner.target)
        direct.Sleep(runner_pb2.RunnerServiceSleepRequest(level=1))
        wait_until(lambda: not any(c.asleep for c in info(direct).model.components), 30, "woken again")
        wait_until(lambda: status(stub).state == W.WORKER_STATE_READY, 30, "READY")
        assert stub.Generate(REQUEST, timeout=60).images[0].data == baseline
        assert "holds state the worker did not ask for" in pair.worker.log()


def test_a_restarted_worker_restores_the_desired_state_from_its_state_file(fake_pair, tmp_path):
    state_file = tmp_path / "state" / "worker.json"
    weights = tmp_path / "perturbed.safetensors"
    weights.write_bytes(b"weights 0")  # the fake runner reads no tensors: the bytes make the digest
    pair: Pair = fake_pair("--state-file", str(state_file))
    with worker_stub(pair.worker.target) as stub:
        version = stub.LoadWeights(W.LoadWeightsRequest(path=str(weights)), timeout=60).weights_version
        perturbed = stub.Generate(REQUEST, timeout=60).images[0].data
        stub.Sleep(W.SleepRequest(level=1), timeout=60)
    pair.worker.stop()
    loads = pair.runner.log().count("loaded tiny")
    pair.worker = start_worker(pair.log_dir, pair.runner.target, "--model", "tiny", "--state-file", str(state_file),
                               ready=False)
    with worker_stub(pair.worker.target, warm=False) as stub:
        restored = wait_until(lambda: (s := status(stub)).state == W.WORKER_STATE_SLEEPING and s, 30, "SLEEPING")
        assert restored.weights_version == version and set(restored.sleeping_components) == {
            "unet", "vae", "text_encoder"}
        assert pair.runner.log().count("loaded tiny") == loads  # the runner already held it: nothing reloaded
        stub.WakeUp(W.WakeUpRequest(), timeout=60)
        assert stub.Generate(REQUEST, timeout=60).images[0].data == perturbed

        # The weights file changes on disk, then the runner restarts: the re-apply refuses it.
        weights.write_bytes(b"weights 1")
        pair.restart_runner(signal.SIGKILL)
        failed = wait_until(lambda: (s := status(stub)).state == W.WORKER_STATE_FAILED and s, 60, "FAILED")
        assert "digest" in failed.message, failed.message
        assert health_status(pair.worker.target, WORKER_SERVICE) == NOT_SERVING


@pytest.fixture(scope="module")
def served(real_runner, tmp_path_factory):
    # One request runs at a time (a step-batching runner takes up to the batch size): the rest queue.
    worker = start_worker(tmp_path_factory.mktemp("hardening"), real_runner.target, "--model", "tiny",
                          "--max-batch-size", "1")
    with worker_stub(worker.target) as stub:
        yield worker, stub
    worker.stop()


def test_a_lifecycle_call_that_timed_out_never_takes_effect(real_runner, served, tmp_path):
    _, stub = served
    weights = tmp_path / "perturbed.safetensors"
    perturbed_weights(weights)
    baseline = stub.Generate(REQUEST, timeout=60)
    # Keep the runner's device busy with a direct Execute, so the LoadWeights waits there: its
    # first step shows it runs, and it runs far longer than the LoadWeights' deadline (checked).
    busy = runner_stub(real_runner.target).Execute(runner_pb2.ExecuteRequest(
        items=[item(seed=3, steps=500, size=256)], progress=True), timeout=600)
    assert next(busy).HasField("progress")
    with pytest.raises(grpc.RpcError) as late:
        stub.LoadWeights(W.LoadWeightsRequest(path=str(weights)), timeout=1.0)
    assert late.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert busy.running(), "the busy Execute ended before the LoadWeights' deadline"
    busy.cancel()  # the LoadWeights the runner was holding may now run: it must not take effect
    wait_until(lambda: status(stub).state == W.WORKER_STATE_READY and status(stub).runners[0].ready, 60,
               "ready again")
    after = stub.Generate(REQUEST, timeout=60)
    assert after.images[0].data == baseline.images[0].data  # the old weights, not the late ones
    assert after.weights_version == baseline.weights_version == status(stub).weights_version
    assert not info(runner_stub(real_runner.target)).weight_updates


@pytest.mark.parametrize("source", ["/no/such/model", "/etc", "tinny"])
def test_a_failed_init_leaves_the_working_model_serving(served, source):
    worker, stub = served
    baseline = stub.Generate(REQUEST, timeout=60).images[0].data
    with pytest.raises(grpc.RpcError) as refused:
        stub.Init(W.InitRequest(model=source), timeout=60)
    assert refused.value.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION,
                                    grpc.StatusCode.NOT_FOUND), refused.value.details()
    assert len(refused.value.details()) < 400
    assert health_status(worker.target, WORKER_SERVICE) == SERVING
    assert status(stub).state == W.WORKER_STATE_READY and status(stub).model.source == "tiny"
    assert stub.Generate(REQUEST, timeout=60).images[0].data == baseline


def test_a_model_that_loads_but_cannot_generate_fails_init_briefly(served, tmp_path):
    """The runner's canary (one step at the smallest size) runs before READY: a scheduler config
    that loads but fails at its first step is refused at Init, in one short line."""
    worker, stub = served
    baseline = stub.Generate(REQUEST, timeout=60).images[0].data
    broken = tiny_model_copy(tmp_path / "broken")
    config_path = broken / "scheduler" / "scheduler_config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**config, "prediction_type": "no-such-prediction"}))
    with pytest.raises(grpc.RpcError) as refused:
        stub.Init(W.InitRequest(model=str(broken)), timeout=120)
    details = refused.value.details()
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION, details
    assert "cannot generate" in details and "no-such-prediction" in details
    assert "\n" not in details and len(details) < 400
    assert status(stub).state == W.WORKER_STATE_READY and status(stub).model.source == "tiny"
    assert stub.Generate(REQUEST, timeout=60).images[0].data == baseline


def test_bad_input_gets_its_real_status_briefly(served):
    _, stub = served
    cases = [
        (lambda: stub.Generate(W.GenerateRequest(guidance_scale=3e38), timeout=10), "guidance_scale"),
        (lambda: stub.Cancel(W.CancelRequest(request_id="x" * 1_000_000), timeout=10), "request_id"),
        (lambda: stub.Sleep(W.SleepRequest(level=1, tags=[f"t{i}" for i in range(10_000)]), timeout=10), "tags"),
        (lambda: stub.WakeUp(W.WakeUpRequest(tags=["x" * 1000]), timeout=10), "tags[0]"),
    ]
    for call, field in cases:
        with pytest.raises(grpc.RpcError) as caught:
            call()
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, caught.value.details()[:200]
        assert field in field_violations(caught.value) and len(caught.value.details()) < 400
    assert status(stub).state == W.WORKER_STATE_READY


def test_get_status_lists_active_requests_with_their_ids(served):
    _, stub = served
    running = Stream(stub, W.GenerateRequest(request_id="long-one", num_inference_steps=60, seed=2))
    running.wait_step(1)
    queued = stub.Generate.future(W.GenerateRequest(request_id="behind", width=128, height=128,
                                                    num_inference_steps=2), timeout=120)
    active = wait_until(lambda: len(a := status(stub).active_requests) == 2 and a, 10, "two active requests")
    assert [(a.request_id, a.state) for a in active] == [("behind", "queued"), ("long-one", "running")]
    assert active[1].step >= 1 and active[1].total_steps == 60 and active[1].age_ms > 0
    stub.Cancel(W.CancelRequest(request_id="long-one"), timeout=5)
    assert queued.result().images
    running.join(30)
    assert not status(stub).active_requests


def runner_lines(log: str, text: str) -> int:
    """How many lines of ``log`` hold ``text``."""
    return sum(text in line for line in log.splitlines())


def cpu_seconds(pid: int) -> float:
    """User plus system CPU time of a process, from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_clients_that_go_away_leave_the_runner_idle(real_runner, served):
    worker, stub = served
    request = W.GenerateRequest(prompt="abandoned", num_inference_steps=60)
    seen = len(real_runner.log())
    started = time.monotonic()
    calls = []
    for _ in range(30):
        call = stub.GenerateStream(W.GenerateStreamRequest(request=request), timeout=120)
        next(call)  # the first event (queued), then the client is gone
        calls.append(call)
    for call in calls:
        call.cancel()
    wait_until(lambda: not status(stub).active_requests, 10, "every abandoned request gone")
    # The runner stops each at its next step boundary: one "stopped ... the call ended" line per
    # Execute it started (none runs to its end), however slow a step is on a loaded machine.
    def every_execute_stopped() -> bool:
        log = real_runner.log()[seen:]
        return runner_lines(log, "the call ended") == runner_lines(log, ": execute ")

    try:
        wait_until(every_execute_stopped, 60, "the runner to stop every abandoned request")
    except AssertionError:
        log = real_runner.log()[seen:]
        raise AssertionError(f"{runner_lines(log, ': execute ')} Execute calls, {runner_lines(log, 'the call ended')} "
                             f"stopped; the runner's log since:\n{log[-6000:]}") from None
    assert runner_lines(real_runner.log()[seen:], "executed in") == 0
    before = cpu_seconds(real_runner.pid)
    time.sleep(2.0)
    spent = cpu_seconds(real_runner.pid) - before
    print(f"runner CPU in the 2 s after 30 clients left ({time.monotonic() - started:.1f} s in): {spent:.2f} s")
    assert spent < 0.3  # idle: one 60-step batch of 4 would take many CPU seconds
    assert status(stub).state == W.WORKER_STATE_READY
