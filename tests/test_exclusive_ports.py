"""Every port is one instance's alone: a second runner or worker started on a taken port exits non-zero
at once, naming the port and its flag, and the first keeps serving (gRPC's SO_REUSEPORT is off)."""

from __future__ import annotations

from pathlib import Path

import pytest
from grpc_health.v1 import health_pb2

from diffusion.v1 import worker_pb2
from harness.processes import (
    ServiceProcess,
    free_port,
    health_status,
    start_service,
    start_worker,
    wait_until,
    worker_stub,
)
from serving_common.protocol import RUNNER_SERVICE, WORKER_SERVICE

pytestmark = pytest.mark.process
SERVING = health_pb2.HealthCheckResponse.SERVING


def refused_start(log_dir: Path, module: str, args: list[str]) -> str:
    """Starts a service that must not start; returns its output once it has exited non-zero."""
    target = args[args.index("--listen") + 1]
    second = start_service("second", module, args, log_dir, target)
    try:
        wait_until(lambda: second.process.poll() is not None or " serving on " in second.log(), 120,
                   "the second instance to exit or serve")
        assert second.process.poll() not in (None, 0), f"a second instance started:\n{second.log()}"
        return second.log()
    finally:
        second.stop(timeout=10)


def still_serves(worker: ServiceProcess, runner: ServiceProcess) -> None:
    assert health_status(runner.target, RUNNER_SERVICE) == SERVING
    assert health_status(worker.target, WORKER_SERVICE) == SERVING
    with worker_stub(worker.target, warm=False) as stub:
        assert stub.Generate(worker_pb2.GenerateRequest(num_inference_steps=1), timeout=60).images


def test_a_second_runner_on_a_taken_port_exits_and_the_first_keeps_serving(tiny_pair, tmp_path):
    runner = tiny_pair.runner
    log = refused_start(tmp_path, "runner_service.main", ["--listen", runner.target, "--device", "cpu"])
    assert f"cannot listen on {runner.target} (--listen)" in log and "another instance" in log, log
    assert "Traceback" not in log
    still_serves(tiny_pair.worker, runner)


def test_a_second_worker_on_a_taken_port_exits_and_the_first_keeps_serving(tiny_pair, tmp_path):
    runner = tiny_pair.runner  # a second worker on the session's runner: it only generates
    metrics, http = free_port(), free_port()
    worker = start_worker(tmp_path, runner.target, "--model", "tiny", "--metrics-port", str(metrics),
                          "--http-port", str(http))
    try:
        fresh = f"127.0.0.1:{free_port()}"
        cases = [
            ([worker.target, "--metrics-port", "0", "--http-port", "0"],
             [f"cannot listen on {worker.target} (--listen)", "another instance"]),
            ([fresh, "--metrics-port", str(metrics), "--http-port", "0"],
             [f"cannot serve metrics on 127.0.0.1:{metrics}", "--metrics-port"]),
            ([fresh, "--metrics-port", "0", "--http-port", str(http)],
             [f"cannot serve the OpenAI API on 127.0.0.1:{http}", "--http-port"]),
        ]
        for (listen, *ports), expected in cases:
            log = refused_start(tmp_path, "worker_service.main", ["--listen", listen, "--runner", runner.target,
                                                                   "--model", "tiny", *ports])
            assert all(text in log for text in expected) and "Traceback" not in log, log
            still_serves(worker, runner)
    finally:
        worker.stop()
