"""A step that cannot be interrupted does not outlive its callers: a real runner process computing one
1024x1024 step of the tiny Flux (minutes on a CPU, tens of seconds on the fastest) ends itself with
code 4 once every request it serves has gone for --overrun-exit-after seconds, and exits within its
--grace after SIGTERM instead of finishing the step for nobody."""

from __future__ import annotations

import signal
import threading

import grpc
import pytest

from diffusion.v1 import runner_pb2, runner_pb2_grpc
from harness.processes import start_runner, wait_until
from runner_service.overrun import OVERRUN_EXIT

pytestmark = pytest.mark.process

SIZE = 1024  # one step of tiny-flux here: longer than the deadline and the bound below on any CPU


def large_execute(target: str, timeout: float | None) -> threading.Thread:
    """Sends one SIZE x SIZE single-step Execute in the background; returns its thread."""
    def call() -> None:
        with grpc.insecure_channel(target) as channel:
            stub = runner_pb2_grpc.RunnerServiceStub(channel)
            request = runner_pb2.ExecuteRequest(progress=True, items=[runner_pb2.ExecuteItem(
                request_id="large", prompt="a", width=SIZE, height=SIZE, num_inference_steps=1, seed=1,
                num_images=1)])
            try:
                for _ in stub.Execute(request, timeout=timeout):
                    pass
            except grpc.RpcError:
                pass  # its deadline, or the runner's end: what the runner does is the test

    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    return thread


def test_a_step_that_outlives_every_caller_ends_the_runner_with_its_own_code(tmp_path):
    runner = start_runner(tmp_path, "--model", "tiny-flux", "--max-size", str(SIZE), "--overrun-exit-after", "1")
    try:
        large_execute(runner.target, timeout=1.0)
        code = runner.process.wait(timeout=120)
        assert code == OVERRUN_EXIT, runner.log()
        assert "--overrun-exit-after 1 s" in runner.log()
    finally:
        runner.stop(signal.SIGKILL)


def test_sigterm_ends_the_runner_within_its_grace_though_a_step_runs(tmp_path):
    runner = start_runner(tmp_path, "--model", "tiny-flux", "--max-size", str(SIZE), "--grace", "1",
                          "--overrun-exit-after", "0")
    try:
        large_execute(runner.target, timeout=None)
        wait_until(lambda: "execute 1 request(s)" in runner.log(), 60, "the runner to start the execution")
        runner.process.send_signal(signal.SIGTERM)
        # Without the exit, the process finishes the step first: minutes on this CPU.
        assert runner.process.wait(timeout=60) == 0, runner.log()
        assert "is not waited for" in runner.log()
    finally:
        runner.stop(signal.SIGKILL)
